"""Learner checkpoints a kill cannot leave half-named (services/learner/checkpoints.py), and the launcher's
stop wait sized to the checkpoint (deploy/launcher_stopping.py).

The kill window is judged on real DeepSpeed ZeRO-3 over 2 gloo ranks: rank 1 dies with its shard half
written once rank 0's shards are on disk and rank 0 waits in DeepSpeed's final barrier (by when DeepSpeed's
own ``latest`` named the new tag); ``latest`` must still name the previous complete tag and a new start must
resume from it.
"""

from __future__ import annotations

import io
import math
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from deploy.launcher_stopping import (
    CHECKPOINT_WAIT_MARGIN_S,
    CHECKPOINT_WRITE_BYTES_PER_S,
    learner_checkpoint_bytes,
    learner_stop_wait,
)
from services.common.ports import free_port
from services.common.tiny_model import TinyModelSpec, build_tiny_model, count_parameters, qwen2_config
from services.learner import checkpoints
from services.learner.checkpoints import LATEST, REPLACED, STAGING, resolve, tag_name
from services.learner.config import LearnerConfig, LoraConfig
from services.learner.local_ranks import run_ranks, scored_groups
from services.learner.supervisor import set_rank_env

KILLED = 37  # rank 1's exit status when it dies mid-save


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("checkpoints") / "model", TinyModelSpec())


def _tag(directory: Path, step: int, files: dict[str, bytes] | None = None, prefix: str = "") -> Path:
    path = directory / f"{prefix}{tag_name(step)}"
    path.mkdir(parents=True)
    for name, data in (files or {"zero_pp_rank_0_mp_rank_00_model_states.pt": b"x"}).items():
        (path / name).write_bytes(data)
    return path


# ---------------------------------------------------------------------------------------------- on disk


def test_a_start_resumes_from_latest_else_from_the_newest_complete_tag(tmp_path: Path) -> None:
    assert resolve(tmp_path) == checkpoints.Found(None) and not resolve(tmp_path).present
    _tag(tmp_path, 1)
    _tag(tmp_path, 2)
    _tag(tmp_path, 3, prefix=STAGING)  # a save cut short: never loaded
    assert resolve(tmp_path).tag == tag_name(2)  # no latest yet: a commit cut short before it
    checkpoints.write_latest(tmp_path, tag_name(1))
    assert resolve(tmp_path).tag == tag_name(1)  # latest is the commit point
    assert checkpoints.committed_step(tmp_path) == 1
    (tmp_path / LATEST).write_text(tag_name(9))  # names a tag that is gone
    assert resolve(tmp_path).tag == tag_name(2)
    for step in (1, 2):
        (tmp_path / tag_name(step) / "zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()
        (tmp_path / tag_name(step)).rmdir()
    found = resolve(tmp_path)
    assert found.tag is None and found.present
    assert f"names the checkpoint tag '{tag_name(9)}'" in found.problem
    assert f"delete {tmp_path / LATEST} to start afresh" in found.problem
    with pytest.raises(RuntimeError, match="does not exist and no other step"):
        checkpoints.agree(found, tmp_path, 0, 1, torch.device("cpu"))


def test_latest_is_replaced_atomically(tmp_path: Path) -> None:
    checkpoints.write_latest(tmp_path, tag_name(1))
    checkpoints.write_latest(tmp_path, tag_name(2))
    assert (tmp_path / LATEST).read_text() == tag_name(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST]  # no temporary file left


def test_pruning_keeps_the_newest_tags_up_to_the_commit_and_removes_leftovers(tmp_path: Path) -> None:
    for step in range(1, 6):
        _tag(tmp_path, step)
    _tag(tmp_path, 7)  # a tag of steps the run resumed from before: no start will load it
    _tag(tmp_path, 6, prefix=STAGING)
    _tag(tmp_path, 3, prefix=REPLACED)
    (tmp_path / "zero_to_fp32.py").write_text("")  # DeepSpeed's script beside the tags stays
    checkpoints.write_latest(tmp_path, tag_name(5))
    checkpoints.prune(tmp_path, tag_name(5), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, tag_name(4), tag_name(5), "zero_to_fp32.py"]


class _Engine:
    """What ``durable_writes`` and ``_commit`` touch of DeepSpeed's checkpoint engine: ``save``."""

    def save(self, state_dict: Any, path: str) -> None:
        Path(path).write_bytes(bytes(state_dict))


def test_each_file_deepspeed_writes_is_fsynced_and_recorded(tmp_path: Path) -> None:
    engine = _Engine()
    written: list[tuple[str, int]] = []
    with checkpoints.durable_writes(engine, written):
        engine.save(b"abc", str(tmp_path / "a.pt"))
        engine.save(b"defgh", str(tmp_path / "b.pt"))
    assert written == [("a.pt", 3), ("b.pt", 5)]
    assert "save" not in vars(engine)  # the class's own method again
    own = engine.save = lambda state_dict, path: None  # type: ignore[method-assign]
    with checkpoints.durable_writes(engine, []):
        assert engine.save is not own
    assert engine.save is own


def test_a_commit_refuses_files_rank_0_does_not_see(tmp_path: Path) -> None:
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _tag(tmp_path, 2, {name: b"1234"}, prefix=STAGING)
    with pytest.raises(RuntimeError, match=r"rank 1's .*optim_states.pt \(9 bytes\).*must be one directory"):
        checkpoints._commit(tmp_path, tag_name(2), [[], [(name, 9)]], keep=2)
    assert not (tmp_path / LATEST).exists() and not (tmp_path / tag_name(2)).exists()


def test_saving_the_committed_step_again_replaces_it(tmp_path: Path) -> None:
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    _tag(tmp_path, 2, {name: b"old"})
    checkpoints.write_latest(tmp_path, tag_name(2))
    _tag(tmp_path, 2, {name: b"newer"}, prefix=STAGING)
    checkpoints._commit(tmp_path, tag_name(2), [[(name, 5)]], keep=2)
    assert (tmp_path / tag_name(2) / name).read_bytes() == b"newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, tag_name(2)]


# ---------------------------------------------------------------------------------------------- stop wait


def _config_dir(path: Path, config: Any) -> str:
    config.save_pretrained(path)  # config.json only: the count needs no weights
    return str(path)


def _tiny_config() -> Any:
    """The built-in tiny model's config (services/common/tiny_model.py), without building its tokenizer."""
    return qwen2_config(TinyModelSpec())


def test_the_learner_stop_wait_covers_a_7b_checkpoint_and_keeps_the_setting_for_a_tiny_one(
    tmp_path: Path,
) -> None:
    from tests.test_memory import qwen25_7b_config

    big = learner_checkpoint_bytes(_config_dir(tmp_path / "7b", qwen25_7b_config()), tmp_path / "none")
    assert big is not None and 90e9 < big < 92e9  # 7.6e9 parameters × 12 B
    wait = learner_stop_wait(120.0, big)
    assert wait.seconds == pytest.approx(big / CHECKPOINT_WRITE_BYTES_PER_S + CHECKPOINT_WAIT_MARGIN_S)
    assert 500 < wait.seconds < 600  # inside the Helm chart's stop grace period (600 s)
    assert "~91.4 GB" in wait.detail and "launcher.stop_timeout_s = 120" in wait.detail
    assert learner_stop_wait(900.0, big).seconds == 900.0  # a longer setting stands
    # with LoRA a checkpoint holds the adapters (rank 16 on every projection: 40.4M weights), not the base
    adapters = learner_checkpoint_bytes(
        _config_dir(tmp_path / "7b", qwen25_7b_config()), tmp_path / "none", LoraConfig(rank=16)
    )
    assert adapters == 40_370_176 * 12
    assert learner_stop_wait(120.0, adapters).seconds == 120.0

    tiny = learner_checkpoint_bytes(_config_dir(tmp_path / "tiny", _tiny_config()), tmp_path / "none")
    assert tiny is not None and tiny < 10e6
    assert learner_stop_wait(120.0, tiny).seconds == 120.0


def test_the_stop_wait_falls_back_to_the_checkpoint_on_disk_then_to_the_setting(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-model")
    assert learner_checkpoint_bytes(missing, tmp_path) is None
    assert learner_stop_wait(120.0, None).seconds == 120.0
    _tag(tmp_path, 3, {"a_optim_states.pt": b"x" * 1000, "b_model_states.pt": b"y" * 24})
    checkpoints.write_latest(tmp_path, tag_name(3))
    assert learner_checkpoint_bytes(missing, tmp_path) == 1024


# ---------------------------------------------------------------------------------------------- kill window


def _mine(groups: list[Any], rank: int, world: int) -> Any:
    from services.learner.batching import place_groups, to_tensors

    return to_tensors([groups[i] for i in place_groups(groups, world)[rank]])


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    from services.learner.publish import gathered_tensors

    return {n: w.detach().clone() for n, w in gathered_tensors(trainer.module)}


def _save_then_die(
    rank: int, world: int, port: int, model_dir: str, steps: list[Any], ckpt: str, signals: str
) -> None:  # a process
    """Step 1, a checkpoint, step 2, a second checkpoint in which rank 1 dies with its first file half
    written, once rank 0 has written its shards and waits in DeepSpeed's final barrier."""
    set_rank_env(rank, world, port)
    import deepspeed.comm

    from services.learner.trainer import Trainer

    trainer = Trainer(LearnerConfig(micro_batch_size=2), model_dir, seed=0)
    trainer.train_step(_mine(steps[0], rank, world))
    trainer.save_checkpoint(Path(ckpt), {"feed": "after step 1"}, keep=2)
    weights = _weights(trainer)
    if rank == 0:
        torch.save(weights, Path(signals) / "weights-step1.pt")
    trainer.train_step(_mine(steps[1], rank, world))
    at_barrier = Path(signals) / "rank0-wrote-its-shards"
    ce = trainer.engine.checkpoint_engine
    if rank == 0:
        saved: list[str] = []
        save, barrier = ce.save, deepspeed.comm.barrier

        def counted(state_dict: Any, path: str) -> Any:
            out = save(state_dict, path)
            saved.append(path)
            return out

        def marked(*args: Any, **kwargs: Any) -> Any:
            if saved:  # the barrier after its own files: DeepSpeed's final one
                at_barrier.touch()
            return barrier(*args, **kwargs)

        ce.save = counted
        deepspeed.comm.barrier = marked
    else:

        def dies(state_dict: Any, path: str) -> None:
            data = io.BytesIO()
            torch.save(state_dict, data)
            Path(path).write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
            # the one collective between rank 0's shards and its `latest` in DeepSpeed's save, ZeRO-3's
            # epilogue (a gather of the persistent weights), holds rank 0's host on gloo until every rank has
            # written; under NCCL it returns once queued on the GPU. Rank 1 joins it now, as NCCL would let
            # rank 0 run on, so rank 0 goes on to its `latest` and the final barrier.
            trainer.engine.optimizer.checkpoint_event_epilogue()
            deadline = time.monotonic() + 300
            while not at_barrier.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)  # rank 0 is inside the barrier now, its `latest` (DeepSpeed's) written before it
            os._exit(KILLED)

        ce.save = dies
    trainer.save_checkpoint(Path(ckpt), {"feed": "after step 2"}, keep=2)


def _resume(rank: int, model_dir: str, steps: list[Any], ckpt: str) -> dict[str, Any]:
    """A new start: load, then step 2 again and checkpoint it (keep 1)."""
    from services.learner.trainer import Trainer

    world = int(os.environ["WORLD_SIZE"])
    trainer = Trainer(LearnerConfig(micro_batch_size=2), model_dir, seed=0)
    state = trainer.load_checkpoint(Path(ckpt))
    weights = _weights(trainer)
    trainer.train_step(_mine(steps[1], rank, world))
    trainer.save_checkpoint(Path(ckpt), {"feed": "after step 2"}, keep=1)
    return {
        "state": None if state is None else {k: state[k] for k in ("version", "step", "feed")},
        "weights": {n: w.numpy().copy() for n, w in weights.items()}
        if rank == 0
        else None,  # not shared memory
        "version": trainer.version,
    }


@pytest.mark.slow
@pytest.mark.timeout(900)  # two starts of two ZeRO-3 ranks on a shared CPU
def test_a_rank_killed_mid_checkpoint_leaves_latest_on_the_previous_one_and_a_start_resumes_from_it(
    model_dir: Path, tmp_path: Path
) -> None:
    ckpt, signals = tmp_path / "checkpoints", tmp_path / "signals"
    signals.mkdir()
    steps = [scored_groups(model_dir, sizes, seed=s) for s, sizes in enumerate([[3, 2], [2, 3]])]
    ctx = mp.get_context("spawn")
    port = free_port()
    args = (str(model_dir), steps, str(ckpt), str(signals))
    procs = [ctx.Process(target=_save_then_die, args=(r, 2, port, *args)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[1].join(600)
        assert procs[1].exitcode == KILLED, procs[1].exitcode
        assert (signals / "rank0-wrote-its-shards").exists()
    finally:
        for p in procs:  # rank 0 waits on its dead peer: killed, as the launcher kills a group past its wait
            if p.is_alive():
                p.kill()
            p.join(30)

    assert (ckpt / LATEST).read_text() == tag_name(1)  # DeepSpeed's own latest named step 2 here
    assert resolve(ckpt).tag == tag_name(1) and checkpoints.committed_step(ckpt) == 1
    assert not (ckpt / tag_name(2)).exists()  # the cut-short save stays under its staging name
    cut = ckpt / f"{STAGING}{tag_name(2)}"
    assert (cut / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()  # rank 0's shards were there
    assert not (cut / "zero_pp_rank_1_mp_rank_00_optim_states.pt").exists()

    out = run_ranks(_resume, 2, str(model_dir), steps, str(ckpt), timeout_s=600)
    assert out[0]["state"] == out[1]["state"] == {"version": 1, "step": 1, "feed": "after step 1"}
    before = torch.load(signals / "weights-step1.pt")
    assert before.keys() == out[0]["weights"].keys()
    assert all(torch.equal(torch.from_numpy(out[0]["weights"][n]), w) for n, w in before.items())  # exactly
    assert out[0]["version"] == out[1]["version"] == 2
    # the new commit of step 2 took the leftover's place; keep = 1 pruned step 1
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == [tag_name(2)]
    assert (ckpt / LATEST).read_text() == tag_name(2)
    # what the launcher's stop wait is sized by is what DeepSpeed wrote
    on_disk = sum(f.stat().st_size for f in (ckpt / tag_name(2)).iterdir())
    expected = learner_checkpoint_bytes(str(model_dir), tmp_path / "none")
    assert expected == checkpoints.checkpoint_bytes(count_parameters(model_dir))
    assert math.isclose(on_disk, expected, rel_tol=0.05), (on_disk, expected)


def test_the_launcher_waits_for_the_learner_as_long_as_its_checkpoint_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from deploy import launcher_services
    from deploy.config import SystemConfig
    from deploy.launcher_stopping import Stopping
    from tests.test_memory import qwen25_7b_config

    qwen25_7b_config().save_pretrained(tmp_path / "7b")
    cfg = SystemConfig.model_validate(
        {"run": {"model": str(tmp_path / "7b"), "run_dir": str(tmp_path / "run")}}
    )
    services = launcher_services.Services(cfg, Stopping(), {}, 0.0)

    class Learner:  # what stop_learner touches of the learner group
        runs = ("run",)

        def stop(self) -> None: ...

        def shutdown(self) -> None: ...

    services.learner = Learner()
    waited: list[float] = []

    def get(refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        waited.append(timeout_s)
        return [{"rank": 0, "step": 3, "version": 3}]

    monkeypatch.setattr(launcher_services, "_get", get)
    services.stop_learner()
    expected = learner_stop_wait(
        cfg.launcher.stop_timeout_s, learner_checkpoint_bytes(str(tmp_path / "7b"), tmp_path)
    )
    assert waited == [expected.seconds] and expected.seconds > 500
    assert f"waiting up to {expected.seconds:.0f}s: its checkpoint of ~91.4 GB" in capsys.readouterr().out
