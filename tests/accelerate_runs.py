"""Training runs with accelerate and the Trainer, a process per rank: ``torchrun ... accelerate_runs.py OUT``.

tests/test_accelerate.py launches this once (with ``ACCELERATE_USE_CPU=true``)
and reads what it writes to OUT: for each run, each rank's final
``state_dict``, the number of all-reduces the run launched (torch.profiler's
``gloo:all_reduce`` events: DDP's and ours alike, the reducer's own
collectives included) and the warnings it raised (``<run>.rank<r>.pt``),
and the folders accelerate's ``save_state`` and the Trainer wrote.

Runs, each against accelerate's or the Trainer's own DDP on the same seed and data:

- accelerate, a small MLP: 10 optimizer steps of 2 micro-batches through
  ``accelerator.accumulate``, ``clip_grad_norm_``, AdamW, ``save_state``;
  in fp32 and bf16 (accelerate's autocast), with DDP (``ddp``) and with
  ``prepare_model`` (``prepare_model``, ``replicated_first``: a model the user
  replicated) and ``ReplicateAccelerator`` (``accelerator``); in fp32 with
  ``DistributedDataParallelKwargs`` (a cap, bucket views, the fp16 comm hook)
  for DDP and ``prepare_model`` (``*_hook``); then each side's
  ``load_state`` of the other's folder (``loaded_*``).
- the Trainer, a tiny GPT-2 from ``GPT2Config`` (no downloads), dropout on,
  accumulation 2, 10 steps, a checkpoint every 5, ``evaluate()``,
  ``save_model()``: with DDP and with ``ReplicateTrainer``, untied
  embeddings in fp32 and bf16, tied in fp32, and with ``model_init`` (fp32);
  and ``ReplicateTrainer`` resumed from DDP's step-5 checkpoint.
- ``ReplicateTrainer`` with ``evaluate()`` before ``train()``
  (``gpt2_replicate_evaluate_first``): no DDP run to compare with, as
  Trainer + DDP then trains without DDP (the evaluation marked the model
  prepared; its replicas drift apart, transformers 5.25, accelerate 1.16).
- what not to do: a model replicated, then given to a plain ``Accelerator``'s
  ``prepare`` (``replicated_then_prepared``): each rank's error.

No re-seeding between the runs' set-up and training: ``replicate()`` draws
nothing from torch's generators (issue 35), so the dropout masks are DDP's.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from torchreplicate import replicate
from torchreplicate.core.registry import find_state
from torchreplicate.integrations.accelerate import ReplicateAccelerator, ReplicateTrainer, prepare_model

STEPS = 10  # optimizer steps
ACCUMULATE = 2  # micro-batches a step
MLP_BATCH = 4  # samples per rank per micro-batch
GPT_BATCH = 2
SEQUENCE = 16
VOCAB = 64
RANKS = int(os.environ.get("WORLD_SIZE", "2"))


def new_accelerate_state() -> None:
    # One process runs fp32 and bf16: accelerate keeps its state in a process-wide singleton that refuses another
    # mixed_precision, and has no public way to start over. Its own tests call this; checked on accelerate 1.16.
    AcceleratorState._reset_state(reset_partial_state=False)


def count_all_reduces(profiled: Any) -> int:
    return sum(1 for event in profiled.events() if event.name == "gloo:all_reduce")


def save(out: Path, run: str, value: dict[str, Any]) -> None:
    torch.save(value, out / f"{run}.rank{dist.get_rank()}.pt")


def cloned(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# -- accelerate, a small MLP ---------------------------------------------------


def mlp(rank: int) -> nn.Module:
    torch.manual_seed(7 + rank)  # a different start on each rank: rank 0's must win, as under DDP
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def mlp_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    count = STEPS * ACCUMULATE * MLP_BATCH * RANKS
    x = torch.randn(count, 8, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def accelerate_run(out: Path, kind: str, precision: str) -> None:
    new_accelerate_state()
    options: dict[str, Any] = {"mixed_precision": precision, "gradient_accumulation_steps": ACCUMULATE}
    if kind.endswith("_hook"):  # DDP's options and comm hook, from accelerate's kwargs handler
        hook = DistributedDataParallelKwargs(
            comm_hook=DDPCommunicationHookType.FP16, bucket_cap_mb=1, gradient_as_bucket_view=True
        )
        options["kwargs_handlers"] = [hook]
    model = mlp(dist.get_rank())
    if kind == "accelerator":
        accelerator: Accelerator = ReplicateAccelerator(**options)
    else:
        accelerator = Accelerator(**options)
    loader = DataLoader(mlp_data(), batch_size=MLP_BATCH, shuffle=False)
    # set-up and training profiled, for every kind: DDP's construction and replicate() both run collectives
    with warnings.catch_warnings(record=True) as caught, profile(activities=[ProfilerActivity.CPU]) as profiled:
        warnings.simplefilter("always")
        if kind == "replicated_first":
            replicate(model, bucket_cap_mb=1)
        if kind in ("prepare_model", "replicated_first", "prepare_model_hook"):
            model = prepare_model(accelerator, model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for x, y in loader:
            with accelerator.accumulate(prepared):
                loss = nn.functional.mse_loss(prepared(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(prepared.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad()
    folder = out / f"mlp_{kind}_{precision}"
    accelerator.save_state(folder)
    unwrapped = accelerator.unwrap_model(prepared)
    state = find_state(unwrapped)  # the options replicate() took: the user's, or mapped from accelerate's
    save(
        out,
        f"mlp_{kind}_{precision}",
        {
            "state_dict": cloned(unwrapped),
            "options": None if state is None else (state.config.bucket_cap_mb, state.config.views),
            "reduction": None if state is None else type(state.reduction).__name__,
            "all_reduces": count_all_reduces(profiled),
            "wrapped": type(prepared).__name__,
            "unwrapped_is_model": unwrapped is model,
            "warnings": [str(w.message) for w in caught if "OMP_NUM_THREADS" not in str(w.message)],
        },
    )


def load_across(out: Path, kind: str, source: str) -> None:
    """An untrained run of ``kind`` loads the fp32 state ``source`` saved; records what it holds."""
    new_accelerate_state()
    model = mlp(dist.get_rank())
    accelerator: Accelerator = ReplicateAccelerator() if kind == "accelerator" else Accelerator()
    if kind == "prepare_model":
        model = prepare_model(accelerator, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state(out / f"mlp_{source}_no")
    moments = [value.clone() for state in optimizer.state_dict()["state"].values() for value in state.values()]
    save(
        out, f"loaded_{kind}_from_{source}", {"state_dict": cloned(accelerator.unwrap_model(prepared)), "adam": moments}
    )


def replicated_then_prepared(out: Path) -> None:
    """What not to do: replicate(), then a plain Accelerator's prepare (DDP on top); writes each rank's error."""
    new_accelerate_state()
    accelerator = Accelerator()
    model = accelerator.prepare(replicate(mlp(dist.get_rank())))
    try:
        model(torch.randn(4, 8))
        message = "no error"
    except RuntimeError as error:
        message = f"{type(model).__name__}: {error}"
    (out / f"replicated_then_prepared.rank{dist.get_rank()}.txt").write_text(message)


# -- transformers.Trainer, a tiny GPT-2 ----------------------------------------


def gpt2(tied: bool = False) -> GPT2LMHeadModel:
    torch.manual_seed(11)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=tied
    )  # GPT-2's dropouts (0.1) on
    return GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the labels the inputs (the model shifts them)."""

    def __init__(self, count: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (count, SEQUENCE), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def training_args(folder: Path, precision: str) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(folder),
        per_device_train_batch_size=GPT_BATCH,
        per_device_eval_batch_size=GPT_BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        learning_rate=3e-3,
        max_grad_norm=1.0,
        save_strategy="steps",
        save_steps=5,
        logging_steps=5,
        eval_strategy="no",
        use_cpu=True,
        bf16=precision == "bf16",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=5,
    )


def trainer_run(
    out: Path,
    run: str,
    kind: str,
    precision: str = "no",
    *,
    tied: bool = False,
    model_init: bool = False,
    resume_from: Optional[Path] = None,
    evaluate_first: bool = False,
) -> None:
    new_accelerate_state()
    folder = out / run
    cls: Callable[..., Trainer] = ReplicateTrainer if kind == "replicate" else Trainer
    model_options: dict[str, Any] = {"model_init": lambda: gpt2(tied)} if model_init else {"model": gpt2(tied)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = cls(
            args=training_args(folder, precision),
            train_dataset=Tokens(STEPS * ACCUMULATE * GPT_BATCH * RANKS, seed=3),
            eval_dataset=Tokens(4 * RANKS, seed=4),
            **model_options,
        )
        if evaluate_first:  # accelerate then marks the model prepared, before train() would wrap it
            trainer.evaluate()
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
        all_reduces = count_all_reduces(profiled)
        metrics = trainer.evaluate()
        trainer.save_model(str(folder / "final"))
    save(
        out,
        run,
        {
            "state_dict": cloned(trainer.model),
            "all_reduces": all_reduces,
            "eval_loss": metrics["eval_loss"],
            "wrapped": type(trainer.model_wrapped).__name__,
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        },
    )


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")  # accelerate and the Trainer find it initialised and use it
    torch.set_num_threads(1)
    for precision in ("no", "bf16"):
        for kind in ("ddp", "prepare_model", "accelerator", "replicated_first"):
            accelerate_run(out, kind, precision)
    for kind in ("ddp_hook", "prepare_model_hook"):
        accelerate_run(out, kind, "no")
    load_across(out, "ddp", "prepare_model")
    load_across(out, "prepare_model", "ddp")
    load_across(out, "accelerator", "ddp")
    trainer_run(out, "gpt2_ddp_no", "ddp")
    trainer_run(out, "gpt2_replicate_no", "replicate")
    trainer_run(out, "gpt2_ddp_bf16", "ddp", "bf16")
    trainer_run(out, "gpt2_replicate_bf16", "replicate", "bf16")
    trainer_run(out, "gpt2_ddp_model_init", "ddp", model_init=True)  # model_init changes the Trainer's run
    trainer_run(out, "gpt2_replicate_model_init", "replicate", model_init=True)
    checkpoint = out / "gpt2_ddp_no" / "checkpoint-5"
    trainer_run(out, "gpt2_replicate_resumed", "replicate", resume_from=checkpoint)
    trainer_run(out, "gpt2_ddp_tied", "ddp", tied=True)
    trainer_run(out, "gpt2_replicate_tied", "replicate", tied=True)
    trainer_run(out, "gpt2_replicate_evaluate_first", "replicate", evaluate_first=True)
    replicated_then_prepared(out)  # last: it leaves a DDP that raised in its forward
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
