"""torch_dist checkpoints: complete and exact in one layout, atomic, asynchronous; loading into
other layouts is proven end to end in tests/functional_tests (resharding)."""
import os
import time

import pytest
import torch

from megatron.training.arguments import STRICTNESS
from megatron.training.checkpointing import read_tracker
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.training.dist_ckpt import CheckpointSaver, load_checkpoint
from tests.unit_tests.training.test_checkpointing import make_state, train_one_step
from tests.unit_tests.model_utils import lm_loss


def saver_state(tmp_path, extra=""):
    args, pgs, state = make_state(tmp_path, extra)
    state.saver = CheckpointSaver(args, pgs, torch.device("cpu"))
    return args, pgs, state


def test_strictness_choices_are_megatron_cores():
    from megatron.core.dist_checkpointing.validation import StrictHandling

    assert STRICTNESS == [s.value for s in StrictHandling]


@pytest.mark.parametrize("extra", ["", "--async-save"])
def test_resume_continues_exactly(tmp_path, extra):
    """Model, fp32 main params, Adam moments and step, schedule, position and RNG come back: the
    step after the load is the step the saving run took (bf16 model, so the main params matter)."""
    args, pgs, state = saver_state(tmp_path, extra)
    for _ in range(2):
        train_one_step(state, args)
    path = state.saver.save(state)
    state.saver.finish(blocking=True)
    assert read_tracker(str(tmp_path)) == 2 and sorted(os.listdir(path)) == [
        ".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt", "metadata.json"]
    rng_after_save = torch.rand(3)
    train_one_step(state, args)
    after = lm_loss(state.model[0], args, seed=5).item()

    _, _, resumed = make_state(tmp_path)
    load_checkpoint(args, resumed, pgs, path)
    assert torch.equal(torch.rand(3), rng_after_save)
    assert (resumed.iteration, resumed.consumed_train_samples) == (2, 2 * args.global_batch_size)
    assert resumed.optimizer.adam_steps() == 2
    train_one_step(resumed, args)
    assert lm_loss(resumed.model[0], args, seed=5).item() == after


def test_async_save_is_published_only_when_written(tmp_path):
    """The tracker moves when the collective finish has run, not when the save was started; the
    training state may change meanwhile without reaching the file (the tensors were copied)."""
    args, pgs, state = saver_state(tmp_path, "--async-save")
    train_one_step(state, args)
    state.saver.save(state)
    saved = {k: v.clone() for k, v in state.model[0].state_dict().items() if torch.is_tensor(v)}
    assert read_tracker(str(tmp_path)) is None and os.path.isdir(tmp_path / "iter_0000001.tmp")
    train_one_step(state, args)  # changes the weights while the writer runs
    state.saver.finish(blocking=True)
    assert read_tracker(str(tmp_path)) == 1 and not os.path.exists(tmp_path / "iter_0000001.tmp")

    _, _, resumed = make_state(tmp_path)
    load_checkpoint(args, resumed, pgs, str(tmp_path / "iter_0000001"))
    for key, value in resumed.model[0].state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, saved[key]), key


def test_checkpoint_without_optimizer_needs_no_load_optim(tmp_path):
    args, pgs, state = saver_state(tmp_path, "--no-save-optim")
    path = state.saver.save(state)
    _, _, fresh = make_state(tmp_path)
    with pytest.raises(ValueError, match="holds no optimizer state: load with --no-load-optim"):
        load_checkpoint(args, fresh, pgs, path)
    args2, _, fresh = make_state(tmp_path, "--no-load-optim")
    load_checkpoint(args2, fresh, pgs, path)
    assert fresh.optimizer.adam_steps() == 0


def test_verify_integrity_finds_a_changed_file(tmp_path):
    args, pgs, state = saver_state(tmp_path, "--verify-integrity")
    train_one_step(state, args)
    path = state.saver.save(state)
    assert "integrity.json" in os.listdir(path)
    _, _, fresh = make_state(tmp_path, "--verify-integrity")
    load_checkpoint(args, fresh, pgs, path)  # intact: loads
    with open(os.path.join(path, "__0_1.distcp"), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))  # one bit flipped on disk
    with pytest.raises(ValueError, match=r"1 file\(s\) missing or changed since saved: __0_1.distcp"):
        load_checkpoint(args, fresh, pgs, path)


def test_every_file_is_on_disk_before_the_checkpoint_is_published(tmp_path, monkeypatch):
    """megatron-core writes common.pt and metadata.json without syncing them; a machine crash
    after the rename must not find them empty: every file and directory of the tree is synced
    before the rename, and the rename before the tracker is written."""
    from megatron.training import checkpointing

    events, sync, rename = [], checkpointing.fsync_path, os.rename
    monkeypatch.setattr(checkpointing, "fsync_path", lambda path: (events.append(("sync", path)), sync(path)))
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", a)), rename(a, b)))
    args, pgs, state = saver_state(tmp_path, "--verify-integrity")
    path = state.saver.save(state)
    tmp = path + ".tmp"
    renamed = events.index(("rename", tmp))
    synced = {p for kind, p in events[:renamed] if kind == "sync"}
    tree = {os.path.join(tmp, os.path.relpath(os.path.join(d, n), path))
            for d, _, files in os.walk(path) for n in files}
    assert tree and tree <= synced and tmp in synced
    assert read_tracker(str(tmp_path)) == 0


def test_async_save_holds_only_host_copies_while_writing(tmp_path, monkeypatch):
    """On a GPU the buckets megatron-core prepares hold device tensors (on CPU it clones views
    itself, so the leak cannot show here): the optimizer's gathered state alone is three fp32
    copies of the model part. Once staged, the writer left in flight must hold only the host
    copies, and nothing else may keep the request (and its device tensors) alive."""
    from megatron.training import dist_ckpt

    args, pgs, state = saver_state(tmp_path, "--async-save")
    train_one_step(state, args)
    staged = []
    real = dist_ckpt._stage_on_host
    monkeypatch.setattr(dist_ckpt, "_stage_on_host", lambda writer: staged.append(real(writer)) or staged[-1])
    state.saver.save(state)
    process, finalize_fns, _, _ = state.saver.pending  # still being written
    writer = finalize_fns[0].args[0]
    assert len(staged) == 1 and writer.write_buckets is staged[0]
    assert not any(isinstance(x, AsyncRequest) for x in state.saver.pending)
    state.saver.finish(blocking=True)


def test_a_save_holds_the_optimizer_state_in_host_memory_once(tmp_path):
    """The tensors a save creates (torch_dist, bf16 model of N parameters, fp32 main copy and two
    moments): each bucket's gathered state (3N fp32 over all buckets, one bucket alive at a time),
    the per-parameter state cut from it (3N, what is written), and megatron-core's copy of the
    weights, which are views of the flat buffer (N bf16; on a GPU the pinned copy instead). The
    flat gathered copy beside the per-parameter one, megatron-core's copies of its views and a
    staging copy of every host tensor made it 12N fp32 and 2N bf16 before."""
    from tests.unit_tests.alloc_count import CreatedTensors

    args, _, state = saver_state(tmp_path)
    train_one_step(state, args)
    n = state.optimizer.buffer.param_data.numel()
    with CreatedTensors() as created:
        state.saver.save(state)
    fp32 = sum(numel for _, numel, dtype in created.created if dtype == torch.float32)
    bf16 = sum(numel for _, numel, dtype in created.created if dtype == torch.bfloat16)
    assert (fp32, bf16) == (6 * n, n)


class _DeviceTensorStandIn:
    """What staging asks of a CUDA tensor: its device, detach() and to(); to() is recorded."""

    def __init__(self, value: torch.Tensor, calls: list):
        self.device, self.value, self.calls = torch.device("cuda", 0), value, calls

    def detach(self):
        return self

    def to(self, device, **kwargs):
        self.calls.append(("copy", device, kwargs))
        return self.value.clone()


def test_staging_copies_device_tensors_without_blocking_then_waits_once(monkeypatch):
    """GPU contract, with CUDA stood in: every device tensor is copied to the host non-blocking (a
    pinned destination: the copies queue, nothing waits per tensor), one wait on the current stream
    follows them all, and host tensors are taken as they are (the fork snapshots them)."""
    from types import SimpleNamespace

    from megatron.training import dist_ckpt

    calls = []
    stream = SimpleNamespace(synchronize=lambda: calls.append(("wait",)))
    monkeypatch.setattr(torch, "get_device_module", lambda device: SimpleNamespace(
        current_stream=lambda d: calls.append(("stream", d)) or stream))
    host = torch.arange(4.0)
    weights = [torch.full((3,), float(i)) for i in range(3)]
    writer = SimpleNamespace(write_buckets=[
        ("__0_0.distcp", "k0", ([], [("w0", _DeviceTensorStandIn(weights[0], calls)), ("opt", host)])),
        ("__0_1.distcp", "k1", ([], [("w1", _DeviceTensorStandIn(weights[1], calls)),
                                     ("w2", _DeviceTensorStandIn(weights[2], calls))])),
    ])
    staged = dist_ckpt._stage_on_host(writer)
    cuda0 = torch.device("cuda", 0)
    assert calls == [("copy", "cpu", {"non_blocking": True})] * 3 + [("stream", cuda0), ("wait",)]
    tensors = [t for _, _, (_, items) in staged for _, t in items]
    assert tensors[1].data_ptr() == host.data_ptr()  # not copied
    assert all(torch.equal(t, w) for t, w in zip([tensors[0], tensors[2], tensors[3]], weights))
    assert writer.write_buckets is staged


def test_the_writer_writes_host_tensors_as_they_were_when_the_save_started(tmp_path):
    """Host tensors are staged without a copy: the writer is forked right after staging, so what
    training changes afterwards never reaches the file."""
    from types import SimpleNamespace

    weights, out = torch.zeros(1000), str(tmp_path / "written.pt")

    def write(_, buckets):
        time.sleep(0.5)  # the parent changes the weights meanwhile
        torch.save(buckets[0], out)
    request = SimpleNamespace(async_fn=write, async_fn_args=[None, None], async_fn_kwargs={},
                              preload_fn=lambda: [weights], finalize_fns=[])
    saver = CheckpointSaver.__new__(CheckpointSaver)
    saver._start(request, 1, None)
    weights.add_(1.0)  # training goes on
    saver.pending[0].join()
    assert saver.pending[0].exitcode == 0 and torch.equal(torch.load(out), torch.zeros(1000))


def _check_load_asks_owned_host_state_and_reads_what_load_returns(tmp_dir, sharded_optimizer):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.training.training import setup
    from tests.unit_tests.dist_utils import grid_groups
    from tests.unit_tests.model_utils import tiny_args, tiny_gpt

    flag = "--use-distributed-optimizer" if sharded_optimizer else ""
    args = tiny_args(f"--save {tmp_dir} --bf16 {flag}", world_size=2)
    pgs = grid_groups()

    def build():
        return setup(args, pgs, lambda a, p, d: tiny_gpt(a, p))
    state = build()
    state.saver = CheckpointSaver(args, pgs, torch.device("cpu"))
    for _ in range(2):
        train_one_step(state, args)
    held, save = [], dist_checkpointing.save
    dist_checkpointing.save = lambda sd, *a, **kw: held.extend(
        (sh.replica_id, sh.data.device.type) for sh in sd["optimizer"].values()) or save(sd, *a, **kw)
    path = state.saver.save(state)
    dist_checkpointing.save = save
    n_params = len(list(state.model[0].parameters()))
    # Sharded or not, each parameter's state in one rank's host memory, written by that rank
    alone = torch.tensor(len(held))
    dist.all_reduce(alone)
    assert alone.item() == 3 * n_params and 0 < len(held) < 3 * n_params
    assert all(replica[-1] == 0 and device == "cpu" for replica, device in held), held
    train_one_step(state, args)

    fresh, asked, real = build(), [], dist_checkpointing.load

    def as_the_fully_parallel_load(sharded, *rest, **kw):
        # On CUDA the fully parallel load hands back the pieces other ranks read as new tensors and
        # leaves the ones it was asked with as they were: zeroed here after a real load.
        asked.extend(sharded["optimizer"].values())
        assert all(sh.data.device.type == "cpu" and sh.data.shape == sh.local_shape for sh in asked)
        loaded = real(sharded, *rest, **kw)
        loaded["optimizer"] = {k: v.clone() for k, v in loaded["optimizer"].items()}
        for sh in asked:
            sh.data.zero_()
        return loaded
    dist_checkpointing.load = as_the_fully_parallel_load  # this rank's process only
    load_checkpoint(args, fresh, pgs, path)
    owned = fresh.optimizer.fragments_of
    assert len(asked) == 3 * len(owned)
    assert len(owned) < n_params if sharded_optimizer else len(owned) == n_params  # not the other rank's
    train_one_step(fresh, args)
    assert torch.equal(fresh.optimizer.main_data, state.optimizer.main_data)


@pytest.mark.parametrize("sharded_optimizer", [True, False])
def test_a_load_asks_only_for_owned_state_in_host_memory_and_takes_what_load_returns(tmp_path, sharded_optimizer):
    """On two data-parallel ranks (with the distributed optimizer or without), a save of the sharded
    state holds each parameter's in one rank's host memory only (not the whole state gathered on
    every rank), and a rank reads the optimizer state of the parameters it owns a piece of only,
    into host tensors (not three fp32 copies of the model part on the device), one rank per piece
    as the main replica, and takes the values from what the load returns: the step after the load
    is the saving run's, bit for bit, though the tensors it asked with were left empty."""
    from tests.unit_tests.dist_utils import run_ranks

    run_ranks(_check_load_asks_owned_host_state_and_reads_what_load_returns, 2, str(tmp_path), sharded_optimizer)


def _check_a_rank_with_nothing_to_write(tmp_dir):
    import torch.distributed as dist
    from megatron.training.training import setup
    from tests.unit_tests.dist_utils import grid_groups
    from tests.unit_tests.model_utils import tiny_args, tiny_gpt

    # the first data-parallel replica writes the model; no optimizer state, no RNG: nothing on rank 1
    flags = "--no-save-optim --no-save-rng --no-ckpt-fully-parallel-save --no-load-optim --no-load-rng --async-save"
    args = tiny_args(f"--save {tmp_dir} --bf16 {flags}", world_size=2)
    pgs = grid_groups()
    state = setup(args, pgs, lambda a, p, d: tiny_gpt(a, p))
    state.saver = CheckpointSaver(args, pgs, torch.device("cpu"))
    train_one_step(state, args)
    path = state.saver.save(state)
    assert (state.saver.pending[0] is None) == (dist.get_rank() == 1)  # no writer forked on rank 1
    assert state.saver.finish(blocking=True) == 1 and read_tracker(tmp_dir) == 1
    fresh = setup(args, pgs, lambda a, p, d: tiny_gpt(a, p))
    load_checkpoint(args, fresh, pgs, path)
    for (name, p), q in zip(fresh.model[0].named_parameters(), state.model[0].parameters()):
        assert torch.equal(p, q), name


def test_a_rank_with_nothing_to_write_takes_part_in_the_save(tmp_path):
    """Without optimizer state and RNG states, and with the first replica writing the model, the
    second data-parallel rank has nothing to write: it forks no writer and still joins the finish."""
    from tests.unit_tests.dist_utils import run_ranks

    run_ranks(_check_a_rank_with_nothing_to_write, 2, str(tmp_path))


def _check_a_failed_write_on_one_rank_raises_on_every_rank(tmp_dir, fmt, where):
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.training import checkpointing
    from megatron.training.training import setup
    from tests.unit_tests.dist_utils import grid_groups
    from tests.unit_tests.model_utils import tiny_args, tiny_gpt

    args = tiny_args(f"--save {tmp_dir} --bf16 --ckpt-format {fmt}", world_size=2)
    pgs = grid_groups()
    state = setup(args, pgs, lambda a, p, d: tiny_gpt(a, p))
    state.saver = CheckpointSaver(args, pgs, torch.device("cpu"))

    def save():
        if fmt == "torch":
            return checkpointing.save_checkpoint(args, state, pgs)
        state.saver.save(state)
        return state.saver.finish(blocking=True)

    def full_disk(*_):
        if dist.get_rank() == 0:
            raise OSError(28, "No space left on device")
    owner, name = (checkpointing, "publish_tree") if where == "publish" else (FileSystemWriterAsync, "finish")
    real = getattr(owner, name)
    setattr(owner, name, lambda *a: (full_disk(), real(*a))[1])  # this rank's process only
    expected = "No space left on device" if dist.get_rank() == 0 else r"on rank\(s\) \[0\]"
    with pytest.raises((OSError, RuntimeError), match=expected):
        save()
    setattr(owner, name, real)
    assert read_tracker(tmp_dir) is None
    state.iteration = 3
    save()  # the next save goes through
    assert read_tracker(tmp_dir) == 3


@pytest.mark.parametrize("fmt, where", [("torch", "publish"), ("torch_dist", "publish"), ("torch_dist", "metadata")])
def test_a_failed_write_on_one_rank_raises_on_every_rank(tmp_path, fmt, where):
    """A file rank 0 alone writes (the rename and tracker, torch_dist's .metadata) fails there: every
    rank raises, where the others used to wait at the next collective until the timeout (the test
    world's 180 s here, NCCL's watchdog in a run), and the next save works."""
    from tests.unit_tests.dist_utils import run_ranks

    run_ranks(_check_a_failed_write_on_one_rank_raises_on_every_rank, 2, str(tmp_path), fmt, where)


def test_a_megatron_lm_common_state_loads(tmp_path):
    """Megatron-LM's common.pt holds args, iteration, schedule and FLOPs, not this trainer's RNG
    layout or Adam steps: the model loads (its RNG is not read), the position carries on, and the
    optimizer state that is not there is asked for in one line."""
    args, pgs, state = saver_state(tmp_path)
    train_one_step(state, args)
    path = state.saver.save(state)
    state.saver.finish(blocking=True)
    common = torch.load(os.path.join(path, "common.pt"), weights_only=False)
    for key in ("rng_saved", "rng_layout", "layout", "optimizer_steps"):
        del common[key]
    torch.save(common, os.path.join(path, "common.pt"))
    fresh_args, _, fresh = make_state(tmp_path, "--no-load-optim")
    load_checkpoint(fresh_args, fresh, pgs, path)
    assert (fresh.iteration, fresh.consumed_train_samples) == (1, state.consumed_train_samples)
    saved = state.model[0].state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in fresh.model[0].state_dict().items() if torch.is_tensor(v))
    with pytest.raises(ValueError, match="holds no optimizer state: load with --no-load-optim"):
        load_checkpoint(args, make_state(tmp_path)[2], pgs, path)


def _stage_streams_follow_their_stage(tmp_dir, order, phase):
    """Each pipeline stage draws from its own streams (seed + 100 x stage): after a load, rank r
    draws what its stage of the saving run would have, whatever stage r was there."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.longseq.parallel_state import RankGrid, build_process_groups
    from megatron.longseq.random import load_rng_state_dict, seed_everything
    from megatron.training.checkpointing import replica_rng_state
    from megatron.training.dist_ckpt import RNG_BY, HostStagedTorchDistSave, _rng_sharded

    pgs = build_process_groups(RankGrid(dist.get_world_size(), pp=2, order=order), 1, interleaved=False)
    stage = pgs.index("pp")
    seed_everything(1234 + 100 * stage, pgs.index("tp"), torch.device("cpu"))
    torch.rand(stage + 1)  # the stages' streams are at different places when saved
    if phase == "save":
        strategy = HostStagedTorchDistSave("torch_dist", 1)
        dist_checkpointing.save({"rng_state": _rng_sharded(pgs, RNG_BY)}, tmp_dir, strategy)
        return
    expected = torch.rand(3)
    seed_everything(0, 0, torch.device("cpu"))
    loaded = dist_checkpointing.load({"rng_state": _rng_sharded(pgs, RNG_BY)}, tmp_dir)
    load_rng_state_dict(replica_rng_state(loaded["rng_state"], pgs))
    assert torch.equal(torch.rand(3), expected), f"rank {dist.get_rank()} (stage {stage}) got another stage's streams"


def test_rng_streams_resume_under_another_rank_order(tmp_path):
    """Saved under the default order, loaded with --use-tp-pp-dp-mapping's (pp 2 x dp 2: ranks 1
    and 2 swap stages): the streams are filed by (pp, tp) rank as Megatron-LM files them, not by
    global rank, so each rank takes its own stage's."""
    from tests.unit_tests.dist_utils import run_ranks

    run_ranks(_stage_streams_follow_their_stage, 4, str(tmp_path), "tp-cp-dp-pp", "save")
    run_ranks(_stage_streams_follow_their_stage, 4, str(tmp_path), "tp-cp-pp-dp", "load")


def test_rng_is_read_when_its_ranks_are_the_same():
    """By (pp, tp) rank: any dp x cp takes the streams (its replicas draw the same), another pipeline
    or tensor split starts its own. By global rank (written before): the same layout only."""
    from types import SimpleNamespace
    from megatron.training.dist_ckpt import _rng_layout
    from tests.unit_tests.dist_utils import grid_groups

    args = SimpleNamespace(no_load_rng=False, finetune=False, no_load_optim=False)
    pgs = grid_groups()  # one rank
    ours = {"rng_saved": True, "rng_layout": "pp,tp", "layout": {"tp": 1, "pp": 1, "dp": 4, "cp": 2}}
    assert _rng_layout(args, "ckpt", ours, pgs) == "pp,tp"
    assert _rng_layout(args, "ckpt", {**ours, "layout": {"tp": 2, "pp": 1, "dp": 2, "cp": 1}}, pgs) is None
    legacy = {"rng_saved": True, "layout": {"tp": 1, "pp": 1, "dp": 1, "cp": 1}}
    assert _rng_layout(args, "ckpt", legacy, pgs) == "rank"
    assert _rng_layout(args, "ckpt", {**legacy, "layout": {"tp": 1, "pp": 1, "dp": 2, "cp": 1}}, pgs) is None
    assert _rng_layout(SimpleNamespace(**{**vars(args), "no_load_rng": True}), "ckpt", ours, pgs) is None
