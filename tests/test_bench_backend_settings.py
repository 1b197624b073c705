"""bench.backend_settings: settings parsed by name, turns that rotate, and a run of two
settings in their own processes whose report compares them cell by cell."""

from __future__ import annotations

import json
import shutil

import pytest

from bench.backend_settings import Setting, code_commit, main, parse_setting, summarize, turn_order
from bench.export_code import export_code
from bench.provenance import REPO


def test_settings_name_mlx_variables_and_code_only(tmp_path):
    assert parse_setting(" default ") == Setting()
    assert parse_setting("MLX_USE_CUDA_GRAPHS=0, MLX_MAX_OPS_PER_BUFFER=200") == Setting({"MLX_USE_CUDA_GRAPHS": "0",
                                                                                           "MLX_MAX_OPS_PER_BUFFER": "200"})
    assert parse_setting(f"code={REPO},MLX_USE_CUDA_GRAPHS=0") == Setting({"MLX_USE_CUDA_GRAPHS": "0"}, str(REPO))
    for bad in ("PATH=/tmp", "MLX_USE_CUDA_GRAPHS", "MLX_USE_CUDA_GRAPHS=", "defaults", f"code={REPO},code={REPO}"):
        with pytest.raises(ValueError, match="MLX_NAME=VALUE or one code=DIR"):
            parse_setting(bad)
    with pytest.raises(ValueError, match=f"{tmp_path} holds no laneserve code"):
        parse_setting(f"code={tmp_path}")


def test_an_earlier_commit_is_exported_as_code(tmp_path):
    short = export_code("HEAD", tmp_path / "code")
    assert (tmp_path / "code" / "COMMIT").read_text() == short + "\n" and code_commit(str(tmp_path / "code")) == short
    assert (tmp_path / "code" / "bench" / "backend_settings.py").is_file()
    assert not list((tmp_path / "code").glob("families/lfm2/default/*/*.safetensors"))
    for taken in (tmp_path / "code", tmp_path / "code" / "COMMIT"):
        with pytest.raises(ValueError, match="is not an empty directory"):
            export_code("HEAD", taken)
    with pytest.raises(ValueError, match="names no commit"):
        export_code("no-such-commit", tmp_path / "other")


def test_every_setting_takes_every_place_in_turn():
    orders = [turn_order(3, a) for a in range(3)]
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert {order[0] for order in orders} == {0, 1, 2}


def test_ratios_pair_runs_of_the_same_alternation():
    answer = lambda tok_s, digest="a": {"tok_s": tok_s, "round_ms": 1000 / tok_s, "digest": digest, "mode_share": 1.0,
                                        "draft_ms": 1.0}
    runs = {(1, "plain", "ref"): [answer(100), answer(50)], (1, "plain", "other"): [answer(120), answer(55)],
            (1, "drafted", "ref"): [answer(200), answer(150)], (1, "drafted", "other"): [answer(180), answer(110)]}
    cells = summarize(["ref", "other"], [1], runs)
    other = cells["1 plain"]["settings"]["other"]
    assert other["vs_reference"]["min"] == pytest.approx(1.1) and other["vs_reference"]["max"] == pytest.approx(1.2)
    assert "vs_reference" not in cells["1 plain"]["settings"]["ref"]
    drafted = cells["1 drafted"]["settings"]["other"]
    assert drafted["vs_plain"]["min"] == pytest.approx(1.5) and drafted["vs_plain"]["max"] == pytest.approx(2.0)
    assert "tail_share" not in drafted  # answers of code before the tail was measured
    for run, full in zip(runs[(1, "drafted", "other")], (270, 132)):
        run |= {"full_tok_s": full, "tail_seconds_share": 0.25}
    drafted = summarize(["ref", "other"], [1], runs)["1 drafted"]["settings"]["other"]
    assert drafted["vs_plain_until_a_lane_ends"]["min"] == pytest.approx(2.25) and drafted["tail_share"]["median"] == 0.25
    assert cells["1 drafted"]["same_tokens"]
    runs[(1, "drafted", "other")][1] = answer(110, digest="b")
    assert not summarize(["ref", "other"], [1], runs)["1 plain"]["same_tokens"]


def test_two_settings_side_by_side(dense_dir, drafter_dir, tmp_path):
    """The second setting adds a variable and runs another copy of this code."""
    code = tmp_path / "code"
    for package in ("bench", "daemon", "families", "lanes"):
        shutil.copytree(REPO / package, code / package, ignore=shutil.ignore_patterns("results", "*.safetensors", "__pycache__"))
    short = "copy-of-this-tree"
    (code / "COMMIT").write_text(short + "\n")
    other = f"MLX_MAX_OPS_PER_BUFFER=50,code={code}"
    main(["--model", str(dense_dir), "--drafter", str(drafter_dir), "--out", str(tmp_path), "--dtype", "float32",
          "--settings", f"default;{other}", "--streams", "1,2", "--gen-tokens", "12", "--alternations", "2"])
    result = json.loads((tmp_path / "backend-settings.json").read_text())
    worker, reference = result["workers"][other], result["workers"]["default"]
    assert worker["settings"]["MLX_MAX_OPS_PER_BUFFER"] == "50" and "MLX_MAX_OPS_PER_BUFFER" not in reference["settings"]
    assert worker["code_dir"] == str(code.resolve()) and worker["commit"] == short
    assert reference["code_dir"] == str(REPO) and reference["code"] == "."
    assert set(result["cells"]) == {"1 plain", "1 drafted", "2 plain", "2 drafted"}
    for row in result["cells"].values():
        assert row["same_tokens"]  # the CPU ignores these settings, and the code is the same: every run emits the same tokens
        assert [len(entry["tok_s_runs"]) for entry in row["settings"].values()] == [2, 2]
    report = (tmp_path / "backend-settings.md").read_text()
    assert f"| 2 | drafted | `{other}` |" in report and f"- `{other}` ran the code of commit {short}" in report
    assert all("tail_share" in entry for entry in result["cells"]["2 drafted"]["settings"].values())


def test_a_bad_setting_is_refused_by_name(dense_dir, drafter_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--model", str(dense_dir), "--drafter", str(drafter_dir), "--out", str(tmp_path), "--settings", "default;CUDA=1"])
    assert stopped.value.code == 2 and "must be MLX_NAME=VALUE or one code=DIR, not 'CUDA=1'" in capsys.readouterr().err


class FakeWorker:
    """A setting's process that answers at a fixed pace, or ends after `lasts` answers
    (a setting named `...=ends-after-N`)."""

    def __init__(self, label, setting, args):
        self.label, self.answered = label, 0
        value = next(iter(setting.env.values()), "")
        self.lasts = int(value.rsplit("-", 1)[1]) if value.startswith("ends-after-") else None
        self.tok_s = 100.0 + 10 * len(setting.env)

    def answer(self, timeout):
        if self.lasts is not None and self.answered >= self.lasts:
            return None
        self.answered += 1
        return {"seconds": 1.0, "settings": {}, "tok_s": self.tok_s, "round_ms": 1000 / self.tok_s, "digest": "same",
                "mode_share": 1.0, "draft_ms": None}

    def ask(self, streams, engine, timeout):
        return self.answer(timeout)

    def ended(self, doing):
        return f"ended {doing}"

    def close(self):
        pass


def test_a_setting_whose_process_ends_is_reported_and_the_rest_go_on(monkeypatch, tmp_path):
    import argparse

    import bench.backend_settings as backend_settings

    monkeypatch.setattr(backend_settings, "Worker", FakeWorker)
    saved = []
    args = argparse.Namespace(settings="default;MLX_A=1;MLX_B=ends-after-3", model="m", drafter="d", dtype=None,
                              decisive=1.0, prompt_tokens=8, gen_tokens=8, alternations=3, streams=[1],
                              load_timeout=60.0, cell_timeout=60.0)
    result = backend_settings.run(args, lambda r: saved.append(r["alternations_done"]))
    # Ready, then two cells in the first alternation, then it ended in the second.
    assert result["failed"] == {"MLX_B=ends-after-3": "ended in alternation 2 (1 streams, plain)"}
    assert saved == [1, 2, 3, 3] and result["alternations_done"] == 3
    plain = result["cells"]["1 plain"]["settings"]
    assert set(plain) == {"default", "MLX_A=1"} and plain["MLX_A=1"]["vs_reference"]["median"] == pytest.approx(1.1)
    assert "- failed: `MLX_B=ends-after-3`" in backend_settings.markdown(result)

    args.settings = "MLX_B=ends-after-0;default"
    result = backend_settings.run(args, lambda r: None)
    assert result["failed"] == {"MLX_B=ends-after-0": "ended while loading"} and result["cells"] == {}


def test_a_control_repeats_the_reference_in_a_process_of_its_own(monkeypatch):
    import argparse

    import bench.backend_settings as backend_settings

    started = {}

    class Recorded(FakeWorker):
        def __init__(self, label, setting, args):
            started[label] = setting
            super().__init__(label, setting, args)

    monkeypatch.setattr(backend_settings, "Worker", Recorded)
    args = argparse.Namespace(settings="MLX_A=1;control;MLX_B=2", model="m", drafter="d", dtype=None, decisive=1.0,
                              prompt_tokens=8, gen_tokens=8, alternations=2, streams=[1], load_timeout=60.0, cell_timeout=60.0)
    result = backend_settings.run(args)
    assert started == {"MLX_A=1": Setting({"MLX_A": "1"}), "control": Setting({"MLX_A": "1"}), "MLX_B=2": Setting({"MLX_B": "2"})}
    assert result["cells"]["1 plain"]["settings"]["control"]["vs_reference"]["median"] == pytest.approx(1.0)
    args.settings = "control;default"
    with pytest.raises(ValueError, match="cannot be the first setting"):
        backend_settings.run(args)


def test_round_times_are_the_engines_own_kind():
    from bench.backend_settings import round_times

    before = {"rounds_by_mode": {"plain": 4}, "seconds_by_mode": {"plain": 0.04}, "draft_seconds": 0.0}
    after = {"rounds_by_mode": {"plain": 5, "drafted": 3}, "seconds_by_mode": {"plain": 0.05, "drafted": 0.09},
             "draft_seconds": 0.03}
    assert round_times(before, after, "drafted") == pytest.approx({"round_ms": 30.0, "mode_share": 0.75, "draft_ms": 10.0})
    plain = round_times(before, after, "plain")
    assert plain["round_ms"] == pytest.approx(10.0) and plain["mode_share"] == pytest.approx(0.25)
    unchanged = round_times(before, before, "drafted")  # no round of its kind: no mean to report
    assert unchanged["round_ms"] is None and unchanged["draft_ms"] is None


def test_a_process_that_answers_nothing_is_stopped():
    import subprocess
    import sys

    from bench.backend_settings import Worker

    worker = Worker.__new__(Worker)
    worker.label, worker.silent_for = "hung", None
    worker.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
    assert worker.ask(1, "plain", timeout=0.5) is None
    assert worker.ended("in alternation 1") == "its process gave no answer within 0.5 s in alternation 1 and was stopped"
    assert worker.process.returncode is not None
    worker.close()
