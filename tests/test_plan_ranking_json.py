"""``python -m lightning_pipe.plan --ranking-json``: every ranked plan with its predictions, as JSON."""

from __future__ import annotations

import json

import yaml

from lightning_pipe import PipelinePlan, PipelineStrategy
from lightning_pipe.lightning.plan_cli import main
from lightning_pipe.planning.profile import Profile
from lightning_pipe.planning.programs import program


def test_ranking_json_lists_every_ranked_plan_best_first(tmp_path, capsys, monkeypatch) -> None:
    from lightning_pipe.lightning import trial

    monkeypatch.setattr(trial, "TRIAL_LAUNCHES", (1, 1))  # one launch: repeating is test_calibration's
    config = tmp_path / "gpt_tiny.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "trainer": {"devices": 2, "strategy": {"init_args": {"pipeline_depth": 2}}},
                "model": {
                    "class_path": "examples.gpt.GPT",
                    "init_args": {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16},
                },
                "data": {
                    "class_path": "examples.gpt.StdlibText",
                    "init_args": {"block_size": 16, "batch_size": 8, "max_bytes": 20000},
                },
            }
        )
    )
    out, ranking, profile = tmp_path / "plan.yaml", tmp_path / "ranking.json", tmp_path / "profile.json"
    # No --script: the config names its classes, and the trial runs through LightningCLI itself.
    argv = ["--config", str(config), "--devices", "2", "--memory", "64MiB", "--trials", "1"]
    argv += ["--no-links", "--virtual-stages", "1", "--top", "3", "--output", str(out), "--ranking-json", str(ranking)]
    assert main(argv + ["--profile-json", str(profile)]) == 0
    printed = capsys.readouterr().out
    table_rows = [r for r in printed.splitlines() if r.startswith("| ") and not r.startswith("| w ")]
    written = json.loads(ranking.read_text())
    plans = written["plans"]
    assert written["devices"] == 2 and written["global_batch"] == 8
    assert len(plans) >= len(table_rows) == 3  # the whole ranking, not only the table's top 3
    feasible = [p for p in plans if p["feasible"]]
    assert feasible == plans[: len(feasible)]  # feasible first, then by predicted step (same global batch)
    steps = [p["step_seconds"] for p in feasible]
    assert steps == sorted(steps)
    for p in plans:
        assert p["width"] * p["depth"] == 2 and p["width"] * p["microbatches"] * p["microbatch_size"] == 8
        assert len(p["peak_bytes_per_rank"]) == p["depth"] and all(b > 0 for b in p["peak_bytes_per_rank"])
        fields = {k: p[k] for k in ("width", "depth", "microbatches", "schedule", "split_backward")}
        keep = ("split_placement", "virtual_stages", "inner", "partition", "recompute")
        PipelinePlan(**fields, **{k: p[k] for k in keep})  # a valid plan, as written
    # The chosen row (the best, or the least memory among those within the noise) is the plan written to --output.
    init = yaml.safe_load(out.read_text())["trainer"]["strategy"]["init_args"]
    best = plans[json.loads(ranking.read_text())["chosen"]]
    assert (init["pipeline_depth"], init["microbatches"], init["schedule"]) == (
        best["depth"],
        best["microbatches"],
        best["schedule"],
    )
    assert init["partition"] == best["partition"] and init["recompute"] == best["recompute"]
    PipelineStrategy(**init)
    # The trial trained the plan the profile ranked first and traced every action of its program on every rank.
    fitted = Profile.from_json(profile.read_text())
    (trial,) = fitted.meta["calibration"]["trials"]
    tried = [p for p in plans if p["trial"]]
    assert "fitted to 1 trial run(s)" in printed and len(tried) == 1 and trial["step"] == tried[0]["step_seconds"] > 0
    ran = PipelinePlan(**{k: tuple(v) if isinstance(v, list) else v for k, v in trial["plan"].items()})
    programs = program(ran)
    expected = [set(map(str, programs[ran.topology.position_of(r)])) for r in range(ran.world_size)]
    assert [set(rank) for rank in trial["actions"]] == expected
    assert all(seconds >= 0 for rank in trial["actions"] for seconds in rank.values())
    assert fitted.compute_scale > 0 and fitted.compute_scale != 1.0
    # The example logs its loss: every rank holds Lightning's copy of it, which every stage's peak counts.
    assert trial["logged_bytes"] >= 4
    assert fitted.device_bytes == fitted.meta["calibration"]["profiled_device_bytes"] + trial["logged_bytes"]
