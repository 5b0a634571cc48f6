"""Hugging Face: ``prepare_model``, ``ReplicateAccelerator`` and ``ReplicateTrainer``, against accelerate's own DDP.

The training runs are real accelerate and ``transformers.Trainer`` runs on 2
CPU processes, launched once by torchrun with ``ACCELERATE_USE_CPU=true``;
tests/accelerate_runs.py says what each does. Each is compared with the same
run under accelerate's (or the Trainer's) DDP, on the same seed and data:
bitwise equal (dropout included: replicate() draws nothing from torch's
generators), with no more all-reduces.

Tied embeddings too: at default options replicate() reduces a tied
parameter whole, in its bucket, as DDP does (its split by rows is an opt-in:
[Note: tied parameters] in reducer/tied_rows.py). replicate() sends one small
all-reduce of flags a step more than DDP's buckets (reducer/flags.py), as
DDP itself does under ``find_unused_parameters=True``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate", reason="the accelerate extra: pip install 'torchreplicate[accelerate]'")
pytest.importorskip("transformers", reason="the test extra pins transformers")

from accelerate.utils import DistributedType  # noqa: E402

from harness import TORCHRUN, run_command  # noqa: E402
from models import MLP  # noqa: E402
from torchreplicate import replicate  # noqa: E402
from torchreplicate.integrations.accelerate import (  # noqa: E402
    ReplicateAccelerator,
    ReplicateTrainer,
    prepare_model,
    refuse_unsupported,
)

HERE = Path(__file__).parent
RANKS = (0, 1)
PRECISIONS = ("no", "bf16")
OURS = ("prepare_model", "accelerator", "replicated_first")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every run of tests/accelerate_runs.py, on 2 ranks, once."""
    out = tmp_path_factory.mktemp("accelerate")
    env = {
        "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)]),
        "ACCELERATE_USE_CPU": "true",  # accelerate's switch to distribute on CPU
        "OMP_NUM_THREADS": "1",
    }
    command = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(HERE / "accelerate_runs.py"), str(out)]
    done = run_command(command, env=env, timeout=420)
    assert done.returncode == 0, f"the accelerate runs failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return out


def load(runs: Path, run: str, rank: int) -> dict[str, Any]:
    return torch.load(runs / f"{run}.rank{rank}.pt", weights_only=False)


def differing(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> list[str]:
    """The state_dict entries that are not bitwise equal (the same keys required)."""
    assert list(ours) == list(theirs), f"different keys: {list(ours)} and {list(theirs)}"
    return [k for k in ours if not torch.equal(ours[k], theirs[k])]


def assert_trained(state_dict: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> None:
    moved = [k for k in start if start[k].is_floating_point() and not torch.equal(state_dict[k], start[k])]
    assert moved, "no parameter moved: the comparison would hold for an untrained model"


# -- accelerate, a small MLP ---------------------------------------------------


@pytest.mark.timeout(480)
@pytest.mark.parametrize(
    ("kind", "precision"),
    [(kind, precision) for precision in PRECISIONS for kind in OURS] + [("prepare_model_hook", "no")],
)
def test_accelerate_loop_bitwise_equal_to_accelerate_ddp(runs, kind, precision):
    import accelerate_runs

    reference = "ddp_hook" if kind.endswith("_hook") else "ddp"
    for rank in RANKS:
        ours, ddp = load(runs, f"mlp_{kind}_{precision}", rank), load(runs, f"mlp_{reference}_{precision}", rank)
        mismatched = differing(ours["state_dict"], ddp["state_dict"])
        assert not mismatched, f"rank {rank}: not bitwise equal to accelerate + DDP: {mismatched}"
        # DDP's buckets, then the flags replicate() sends at every synchronised backward in a small
        # all-reduce of their own (reducer/flags.py; DDP sends one too, under find_unused_parameters=True)
        extra = 10  # 10 steps
        assert ours["all_reduces"] <= ddp["all_reduces"] + extra, (
            f"rank {rank}: {ours['all_reduces']} all-reduces, DDP {ddp['all_reduces']}"
        )
        assert ours["wrapped"] == "Sequential", f"rank {rank}: accelerator.prepare wrapped the model: {ours['wrapped']}"
        assert ours["unwrapped_is_model"], f"rank {rank}: accelerator.unwrap_model did not give the model back"
        assert not ours["warnings"], f"rank {rank}: warnings: {ours['warnings']}"
    assert ddp["wrapped"] == "DistributedDataParallel", "the reference did not run under DDP"
    # replicate()'s options: the user's for a model replicated first, else mapped from DistributedDataParallelKwargs
    expected = {"replicated_first": (1, True), "prepare_model_hook": (1, True)}.get(kind, (None, True))
    assert ours["options"] == expected, f"replicate() took {ours['options']}, expected {expected}"
    hooked = "HookReduction" if kind.endswith("_hook") else "AllReduce"
    assert ours["reduction"] == hooked, f"the reduction is {ours['reduction']}: accelerate's comm hook not mapped"
    assert_trained(ours["state_dict"], accelerate_runs.mlp(0).state_dict())  # rank 0's start, which every rank took


@pytest.mark.timeout(480)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", OURS)
def test_save_state_writes_ddps_weights_file(runs, kind, precision):
    ours = (runs / f"mlp_{kind}_{precision}" / "model.safetensors").read_bytes()
    ddp = (runs / f"mlp_ddp_{precision}" / "model.safetensors").read_bytes()
    assert ours == ddp, "save_state's model.safetensors differs from accelerate + DDP's"


@pytest.mark.timeout(480)
def test_load_state_across_ddp_and_ours(runs):
    for rank in RANKS:
        ours = load(runs, "mlp_prepare_model_no", rank)["state_dict"]
        ddp = load(runs, "mlp_ddp_no", rank)["state_dict"]
        for loader, source, expected in (
            ("ddp", "prepare_model", ours),
            ("prepare_model", "ddp", ddp),
            ("accelerator", "ddp", ddp),
        ):
            loaded = load(runs, f"loaded_{loader}_from_{source}", rank)
            mismatched = differing(loaded["state_dict"], expected)
            assert not mismatched, f"rank {rank}: {loader} loading {source}'s save_state: {mismatched}"
        into_ddp, into_ours = (
            load(runs, "loaded_ddp_from_prepare_model", rank),
            load(runs, "loaded_prepare_model_from_ddp", rank),
        )
        assert into_ours["adam"] and all(
            torch.equal(a, b) for a, b in zip(into_ddp["adam"], into_ours["adam"], strict=True)
        ), f"rank {rank}: AdamW's state differs after loading across"


# -- transformers.Trainer, a tiny GPT-2 ----------------------------------------


@pytest.mark.timeout(480)
@pytest.mark.parametrize("run", ["no", "bf16", "model_init"])
def test_trainer_bitwise_equal_to_trainer_ddp(runs, run):
    for rank in RANKS:
        ours, ddp = load(runs, f"gpt2_replicate_{run}", rank), load(runs, f"gpt2_ddp_{run}", rank)
        mismatched = differing(ours["state_dict"], ddp["state_dict"])
        assert not mismatched, f"rank {rank}: not bitwise equal to Trainer + DDP: {mismatched}"
        assert ours["eval_loss"] == ddp["eval_loss"], f"rank {rank}: evaluate() differs"
        assert ours["wrapped"] == "GPT2LMHeadModel" and ddp["wrapped"] == "DistributedDataParallel"
    folder = runs / f"gpt2_replicate_{run}"
    for checkpoint in ("checkpoint-5", "checkpoint-10", "final"):
        config = json.loads((folder / checkpoint / "config.json").read_text())
        assert config["architectures"] == ["GPT2LMHeadModel"], f"{checkpoint}: {config['architectures']}"
    assert_trained(ours["state_dict"], _gpt2_start(tied=False))


def _gpt2_start(tied: bool) -> dict[str, torch.Tensor]:
    import accelerate_runs

    return accelerate_runs.gpt2(tied).state_dict()


@pytest.mark.timeout(480)
@pytest.mark.parametrize("run", ["no", "bf16", "model_init"])
def test_trainer_find_unused_default_no_warning_and_no_more_all_reduces(runs, run):
    # The Trainer asks DDP for find_unused_parameters=True (a GPT2LMHeadModel without checkpointing): DDP then
    # all-reduces its used-parameter bitmap at every step, as replicate() sends its flags; it says nothing
    for rank in RANKS:
        ours, ddp = load(runs, f"gpt2_replicate_{run}", rank), load(runs, f"gpt2_ddp_{run}", rank)
        assert ours["all_reduces"] <= ddp["all_reduces"], f"rank {rank}: {ours['all_reduces']} vs {ddp['all_reduces']}"
        assert not ours["warnings"], f"rank {rank}: warnings: {ours['warnings']}"


@pytest.mark.timeout(480)
def test_trainer_resumed_from_a_ddp_checkpoint_equals_the_uninterrupted_ddp_run(runs):
    for rank in RANKS:
        resumed, whole = load(runs, "gpt2_replicate_resumed", rank), load(runs, "gpt2_ddp_no", rank)
        mismatched = differing(resumed["state_dict"], whole["state_dict"])
        assert not mismatched, f"rank {rank}: resumed from DDP's checkpoint-5, differs from DDP's run: {mismatched}"
        assert 0 < resumed["all_reduces"] < whole["all_reduces"], "the resumed run did not train the last steps"


@pytest.mark.timeout(480)
def test_trainer_tied_embeddings_bitwise_equal_to_ddp(runs):
    # at default options the tied parameter is reduced whole, in its bucket, as DDP's (no rows round)
    for rank in RANKS:
        ours, ddp = (
            load(runs, "gpt2_replicate_tied", rank)["state_dict"],
            load(runs, "gpt2_ddp_tied", rank)["state_dict"],
        )
        mismatched = differing(ours, ddp)
        assert not mismatched, f"rank {rank}: the tied GPT-2 differs from DDP's: {mismatched}"


@pytest.mark.timeout(480)
def test_trainer_evaluate_before_train_still_replicates(runs):
    # evaluate() first prepares the model in evaluation mode (accelerate's "prepared" mark), and Trainer + DDP's
    # train() then leaves it unwrapped; ReplicateTrainer replicates at train(): the replicas stay bitwise equal
    ours = [load(runs, "gpt2_replicate_evaluate_first", rank)["state_dict"] for rank in RANKS]
    mismatched = differing(ours[1], ours[0])
    assert not mismatched, f"rank 1's replica differs from rank 0's: {mismatched}"
    assert_trained(ours[0], _gpt2_start(tied=False))
    assert load(runs, "gpt2_replicate_evaluate_first", 0)["all_reduces"] > 0, "nothing was averaged"


@pytest.mark.timeout(480)
def test_replicated_then_a_plain_prepare_is_refused_on_every_rank(runs):
    # accelerate wraps the replicated model in DDP: the first forward raises on every rank (issue 35's refusal)
    for rank in RANKS:
        message = (runs / f"replicated_then_prepared.rank{rank}.txt").read_text()
        assert message.startswith("DistributedDataParallel: replicate(): rank ") and "prepare_model" in message, message


# -- unwrapping, refusals, options ----------------------------------------------


def check_unwrapping(rank, world_size):
    from accelerate.utils import extract_model_from_parallel
    from transformers import GPT2Config, GPT2LMHeadModel, modeling_utils

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    ddp_keys = list(torch.nn.parallel.DistributedDataParallel(GPT2LMHeadModel(config)).module.state_dict())
    model = replicate(GPT2LMHeadModel(config))
    view = model.module
    assert list(view.state_dict()) == ddp_keys == list(model.state_dict()), f"rank {rank}: keys differ from DDP's"
    unwrapped = extract_model_from_parallel(model, recursive=True)  # RecursionError when model.module was model
    assert unwrapped is view and list(unwrapped.state_dict()) == ddp_keys, f"rank {rank}: {type(unwrapped)}"
    assert extract_model_from_parallel(model) is model, f"rank {rank}: the plain unwrap is not the model"
    available = modeling_utils.is_accelerate_available
    modeling_utils.is_accelerate_available = lambda *args, **kwargs: False  # transformers' own loop over .module
    try:
        assert modeling_utils.unwrap_model(model) is view, f"rank {rank}: transformers' unwrap_model"
    finally:
        modeling_utils.is_accelerate_available = available
    found = model
    for _ in range(3):  # DDP code's `while hasattr(m, "module"): m = m.module` ends after one step
        if not hasattr(found, "module"):
            break
        found = found.module
    assert found is view, f"rank {rank}: the .module loop did not end at the view"
    assert type(view).__name__ == "GPT2LMHeadModel" and isinstance(view, GPT2LMHeadModel)


def test_recursive_unwrapping_ends_and_model_module_has_ddps_keys(pools):
    pools.run(2, check_unwrapping)


def check_trigger_sync_in_backward(rank, world_size):
    model = replicate(MLP())
    x = torch.full((2, 32), float(rank + 1))
    with model.no_sync():
        model(x).sum().backward()  # local only
        local = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        with ReplicateAccelerator.trigger_sync_in_backward(model):
            assert replicate.state(model).requires_gradient_sync
            model(x).sum().backward()  # averaged, inside no_sync
        assert not replicate.state(model).requires_gradient_sync, f"rank {rank}: the switch was not restored"
    for p, mine in zip(model.parameters(), local):
        copies = [torch.empty_like(p.grad) for _ in range(world_size)]
        torch.distributed.all_gather(copies, p.grad)
        assert torch.equal(copies[0], copies[1]), f"rank {rank}: not averaged under trigger_sync_in_backward"
        if not torch.equal(mine, p.grad):
            break
    else:
        raise AssertionError(f"rank {rank}: the gradients are the local ones")


def test_trigger_sync_in_backward_averages_inside_no_sync(pools):
    pools.run(2, check_trigger_sync_in_backward)


@pytest.mark.parametrize(
    "kind", [DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA]
)
def test_other_parallelisms_are_refused(kind):
    # a pure function of the configuration, which every rank holds alike: every rank raises this
    accelerator = SimpleNamespace(distributed_type=kind, parallelism_config=None)
    with pytest.raises(ValueError, match=f"configured for {kind.value}, which shards or wraps the model itself"):
        prepare_model(accelerator, torch.nn.Linear(2, 2))


def test_tensor_and_context_parallelism_are_refused():
    config = SimpleNamespace(tp_enabled=True, cp_enabled=True, sp_enabled=False, dp_shard_enabled=False)
    accelerator = SimpleNamespace(distributed_type=DistributedType.MULTI_GPU, parallelism_config=config)
    with pytest.raises(ValueError, match="parallelism_config enables tp, cp .*set those sizes to 1"):
        refuse_unsupported(accelerator, "ReplicateTrainer")


def test_world_size_without_a_distributed_accelerate_warns_naming_the_variable(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    accelerator = SimpleNamespace(distributed_type=DistributedType.NO, parallelism_config=None)
    with pytest.warns(UserWarning, match="WORLD_SIZE is 2 but accelerate is not distributed.*ACCELERATE_USE_CPU=true"):
        refuse_unsupported(accelerator)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        refuse_unsupported(accelerator)


@pytest.mark.parametrize("entry", [ReplicateAccelerator, ReplicateTrainer])
def test_options_are_checked_before_anything_is_built(entry):
    with pytest.raises(
        TypeError, match=r"unknown option bucket_cap=; it takes replicate\(\)'s options: .*bucket_cap_mb"
    ):
        entry(replicate_options={"bucket_cap": 25})
    with pytest.raises(TypeError, match="device_id= is not accepted: accelerate moves the module to its device"):
        entry(replicate_options={"device_id": 0})
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        entry(replicate_options={"bucket_cap_mb": -1})
    with pytest.raises(TypeError, match="unknown option bucket=; it takes"):
        prepare_model(SimpleNamespace(), torch.nn.Linear(2, 2), bucket=1)


def test_import_does_not_import_transformers():
    code = (
        "import sys, torchreplicate.integrations.accelerate as a; assert 'transformers' not in sys.modules; "
        "a.ReplicateTrainer; assert 'transformers' in sys.modules"
    )
    done = run_command([sys.executable, "-c", code], env={"PYTHONPATH": str(HERE.parent / "src")}, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
