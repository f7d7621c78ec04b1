"""Five tuned per-step quintics (XTuner's and modded-nanogpt's medium track)."""

from .base import Schedule

SCHEDULE = Schedule(
    name="xtuner",
    table=(
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    source=("Coefficients tuned per step by F. L. Cesista, https://leloykun.github.io/ponder/muon-opt-coeffs/ ; "
            "numbers as in KellerJordan/modded-nanogpt train_gpt_medium.py and XTuner's Muon (also NVIDIA "
            "Emerging-Optimizers' 'quintic')"),
)
