import torch

from muonlab import compare_optimizers
from muonlab.data import get_batch, load_corpus, prepare_corpus
from muonlab.models import GPTConfig


def test_corpus_is_real_python_with_fixed_split():
    path = prepare_corpus()
    train, val = load_corpus("train"), load_corpus("val")
    assert len(train) + len(val) == path.stat().st_size
    assert abs(len(val) / (len(train) + len(val)) - 0.1) < 1e-3
    head = bytes(train[:200].tolist()).decode()
    assert head.startswith("# file: ") and ".py" in head.splitlines()[0]
    assert prepare_corpus() == path  # cached


def test_batches_are_next_byte_targets_and_seeded():
    data = load_corpus("val")
    x, y = get_batch(data, 3, 16, torch.Generator().manual_seed(0))
    x2, _ = get_batch(data, 3, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 16) and torch.equal(x, x2)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_both_optimizers_train_the_small_gpt():
    cfg = GPTConfig(d_model=32, n_layers=1, context=32)
    hist = compare_optimizers(cfg, steps=30, batch_size=8, eval_every=10, progress=False)
    for name, h in hist.items():
        assert len(h.train_loss) == 30 and h.val_steps == [10, 20, 30]
        assert h.val_loss[-1] < 4.5 < h.train_loss[0], name  # ln(256) = 5.55 at init
        assert h.summary()["opt_step_ms"] > 0
