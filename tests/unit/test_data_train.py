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


def test_every_window_start_is_drawn_so_the_last_byte_is_a_target():
    import pytest

    data = torch.arange(20, dtype=torch.uint8)
    _, y = get_batch(data, 2000, 4, torch.Generator().manual_seed(0))
    assert int(y.max()) == 19  # the window starting at 15 holds the last byte as its last target
    x, y = get_batch(data, 1, 19)  # exactly context + 1 bytes: one window
    assert x.tolist() == [list(range(19))] and y.tolist() == [list(range(1, 20))]
    with pytest.raises(ValueError, match="too short for context 20"):
        get_batch(data, 1, 20)
    for bad in (dict(batch_size=0, context=4), dict(batch_size=2, context=0), dict(batch_size=2.0, context=4)):
        with pytest.raises(ValueError, match="must be a whole number >= 1"):
            get_batch(data, **bad)


def test_a_corpus_smaller_than_the_minimum_is_refused_naming_max_bytes(tmp_path):
    import pytest

    for bad in (50_000, 0, -5, 1e6):
        with pytest.raises(ValueError, match=f"max_bytes must be a whole number >= 100000, got {bad!r}"):
            prepare_corpus(tmp_path, max_bytes=bad)
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_make_optimizer_passes_adamw_settings_on_and_refuses_others():
    import pytest

    from muonlab import make_optimizer

    model = torch.nn.Linear(4, 4)
    opt = make_optimizer("adamw", model, betas=(0.9, 0.999), eps=1e-6)
    assert opt.defaults["betas"] == (0.9, 0.999) and opt.defaults["eps"] == 1e-6
    assert make_optimizer("adamw", model).defaults["betas"] == (0.9, 0.95)
    with pytest.raises(TypeError, match="ns_steps"):
        make_optimizer("adamw", model, ns_steps=3)


def test_compare_optimizers_refuses_names_it_would_misread_before_training():
    import pytest

    cfg = GPTConfig(d_model=16, n_layers=1, context=8)
    with pytest.raises(TypeError, match=r"names must be a sequence of optimizer names, e.g. \('muon',\)"):
        compare_optimizers(cfg, steps=1, names="muon")
    with pytest.raises(ValueError, match="names must be distinct"):
        compare_optimizers(cfg, steps=1, names=("muon", "muon"))
    with pytest.raises(ValueError, match="names must be distinct"):
        compare_optimizers(cfg, steps=1, names=("sgd",))
    with pytest.raises(ValueError, match=r"optimizer_kwargs names \['AdamW'\]"):
        compare_optimizers(cfg, steps=1, names=("adamw",), optimizer_kwargs={"AdamW": {"lr": 1.0}})


def test_gpt_config_refuses_sizes_that_build_no_model():
    import pytest

    for field, bad in (("n_heads", 0), ("n_heads", -4), ("n_layers", -1), ("n_layers", 0), ("d_model", 0),
                       ("vocab_size", 0), ("context", 0), ("mlp_ratio", 0), ("num_experts", -1), ("d_model", 64.0)):
        with pytest.raises(ValueError, match=f"GPTConfig.{field} must be a whole number"):
            GPTConfig(**{field: bad})


def test_moe_gates_are_the_router_probability_for_top1_and_renormalised_above():
    from muonlab.models import GPT
    from muonlab.models.gpt import moe_config

    torch.manual_seed(0)
    x = torch.randn(12, 16)
    for top_k in (1, 2):
        moe = GPT(moe_config(num_experts=4, top_k=top_k, d_model=16, n_layers=1, n_heads=2, context=8)).blocks[0].mlp
        token, gate, counts = moe.route(x)
        probs = moe.router(x).softmax(-1)
        expert = torch.repeat_interleave(torch.arange(4), counts)
        if top_k == 1:  # Switch routing: the raw probability, so the router's logits get a gradient
            torch.testing.assert_close(gate, probs[token, expert])
        else:  # each token's k gates share one unit of weight
            totals = torch.zeros(len(x)).index_add_(0, token, gate.detach())
            torch.testing.assert_close(totals, torch.ones(len(x)))
        moe(x.view(3, 4, 16)).square().sum().backward()
        assert moe.router.weight.grad.norm() > 1e-3 * moe.w_in.grad.norm(), top_k


def test_the_demo_command_refuses_bad_arguments_before_training(tmp_path, monkeypatch, capsys):
    import pytest

    from muonlab import cli

    afile = tmp_path / "afile"
    afile.write_text("")
    cases = [(["demo", "--steps", "0"], "argument --steps: invalid positive_int value: '0'"),
             (["demo", "--layers", "-1"], "argument --layers: invalid positive_int value: '-1'"),
             (["demo", "--width", "6"], "--width must be a multiple of 4"),
             (["demo", "--out", str(afile)], "is an existing file, not a folder")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as stop:
            cli.main(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err
    monkeypatch.setenv("MUONLAB_DEMO_STEPS", "abc")
    with pytest.raises(SystemExit) as stop:
        cli.main(["--help"])  # help still works
    assert stop.value.code == 0
    with pytest.raises(SystemExit) as stop:
        cli.main(["demo"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "$MUONLAB_DEMO_STEPS must be a whole number >= 1, got 'abc'" in err


def test_the_demo_command_refuses_a_bad_device_env_and_an_out_under_a_file_before_training(
        tmp_path, monkeypatch, capsys):
    import pytest

    import muonlab.demo as demo
    from muonlab import cli

    def no_training(*args, **kwargs):  # a check that lets a case through must not cost minutes
        raise AssertionError("the demo started training")

    monkeypatch.setattr(demo, "run", no_training)
    afile = tmp_path / "afile"
    afile.write_text("")
    out = str(tmp_path / "figures")
    for sub in ("sub", "sub/deeper"):
        with pytest.raises(SystemExit) as stop:
            cli.main(["demo", "--out", str(afile / sub), "--nprocs", "1"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and f"'{afile}' is an existing file, not a folder" in err, err
    monkeypatch.setenv("MUONLAB_DEVICE", "gpu")
    with pytest.raises(SystemExit) as stop:
        cli.main(["demo", "--out", out, "--nprocs", "2"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "$MUONLAB_DEVICE must be one of ('auto', 'cpu', 'cuda'), got 'gpu'" in err
    with pytest.raises(AssertionError, match="started training"):  # one process: the variable is not read
        cli.main(["demo", "--out", out, "--nprocs", "1"])


def test_check_out_dir_accepts_new_folders_under_writable_ones_and_refuses_the_rest(tmp_path):
    import os

    import pytest

    from muonlab.demo import check_out_dir

    check_out_dir(tmp_path / "a" / "b" / "c")  # made when the figures are saved
    check_out_dir(tmp_path)
    check_out_dir("runs/demo")  # relative: under the working folder
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match="can't be made: .*afile' is an existing file"):
        check_out_dir(tmp_path / "afile" / "x" / "y")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="is an existing file, not a folder"):
        check_out_dir(tmp_path / "dangling" / "x")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="may not write in the folder .*locked'"):
            check_out_dir(locked / "x")
