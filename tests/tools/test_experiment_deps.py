"""`kvps experiment` checks its optional dependencies before it runs anything: without scikit-learn
it used to start every run and fail the digits ones one by one with ModuleNotFoundError; now one
message names the extra to install, and nothing starts."""
import importlib.util

from kvps.tools.experiment import cli, runner


def test_without_scikit_learn_one_message_names_the_extra(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a))
    started = []
    for name in dir(runner):
        if name.startswith("run") and callable(getattr(runner, name)):
            monkeypatch.setattr(runner, name, lambda *a, **k: started.append(a))
    assert cli.main(["--tiny", "--out", str(tmp_path)]) == cli.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "scikit-learn is not installed" in err and "pip install 'kvps[experiment]'" in err
    assert not started and not any(tmp_path.iterdir())
