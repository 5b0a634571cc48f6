"""Training runs with Lightning, one process per rank: ``torchrun --nproc-per-node N lightning_runs.py OUT``.

tests/test_lightning.py launches this once and reads what it writes to OUT:
for each run, each rank's final parameters and buffers, the logged loss,
the gradient-sync flag seen at every backward, and the results of the
strategy's collectives (``<run>.rank<r>.pt``); for each refusal, each rank's
error message (``<case>.rank<r>.txt``). Runs: the Trainer with
``strategy="ddp"`` and with ours (by name and by object, and a run cut after
one epoch, checkpointed and resumed by a new Trainer); Fabric the same way.
With ``--averaging`` after OUT, only the runs that compare the averaged parameters
(the Trainer and Fabric, each with ``"ddp"`` and with ours), for more than 2
ranks: with two, any correct mean is bitwise the same. Runs on as many
devices as torchrun started ranks. Tiny on purpose: a 2-core machine runs
the whole file in seconds.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchreplicate import replicate
from torchreplicate.core.registry import find_state
from torchreplicate.integrations.lightning import FabricReplicateStrategy, ReplicateStrategy

NUM_SAMPLES = 16  # 4 batches of 2 per rank per epoch: 2 optimizer steps with accumulation 2
ACCUMULATE = 2
EPOCHS = 2
DEVICES = int(os.environ.get("WORLD_SIZE", "2"))  # torchrun's ranks
# Adam, except in the averaging runs: the first Linear's bias, followed by a
# BatchNorm, has a true gradient of zero, so its computed gradient is rounding
# noise, which Adam scales up to full-size steps; SGD keeps a rounding
# difference between two correct means a rounding difference.
OPTIMIZER: Callable[..., torch.optim.Optimizer] = torch.optim.Adam


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(NUM_SAMPLES, 4, generator=generator), torch.randn(NUM_SAMPLES, 1, generator=generator)
    )


def network() -> nn.Module:
    # a different start on each rank: the strategy must give every rank rank 0's
    torch.manual_seed(7 + int(os.environ.get("RANK", 0)))  # torchrun's rank: known before the group is up
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = network()
        self.sync_flags: list[bool] = []  # replicate's gradient-sync switch at each backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)  # the layers, not self(x): the strategy must still sync
        self.log("train_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
        return loss

    def on_after_backward(self) -> None:
        state = find_state(self)
        if state is not None:
            self.sync_flags.append(state.requires_gradient_sync)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZER(self.parameters(), lr=0.05)


def trainer(strategy: Any, max_epochs: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=DEVICES,
        strategy=strategy,
        max_epochs=max_epochs,
        accumulate_grad_batches=ACCUMULATE,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def loader(shuffle: bool = True) -> DataLoader:
    # Fabric sets the sampler's epoch to the loader's count of iterations, which a
    # resumed job's new loader restarts: its runs do not shuffle
    return DataLoader(data(), batch_size=2, shuffle=shuffle)


def collectives(strategy: Any) -> dict[str, Any]:
    """What the strategy's own collectives return (barrier, broadcast, reduce / all_reduce)."""
    rank = dist.get_rank()
    strategy.barrier("end")
    reduce = getattr(strategy, "reduce", None) or strategy.all_reduce
    return {
        "broadcast": strategy.broadcast({"from": rank}),
        "mean": reduce(torch.tensor(float(rank + 1))).item(),
        "sum": reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item(),
    }


def result(module: nn.Module, **extra: Any) -> dict[str, Any]:
    # rng: torch's default generator after the run (each run seeds it in network()): a strategy
    # that draws from it moves every later random number of the user's program
    state_dict = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"state_dict": state_dict, "rng": torch.get_rng_state(), **extra}


def save(out: Path, run: str, value: dict[str, Any]) -> None:
    torch.save(value, out / f"{run}.rank{dist.get_rank()}.pt")


def fit_trainer(out: Path, run: str, strategy: Callable[[], Any]) -> None:
    model = Regression()
    fitted = trainer(strategy(), EPOCHS)
    fitted.fit(model, loader())
    save(
        out,
        run,
        result(
            model,
            loss=fitted.callback_metrics["train_loss"].item(),
            sync_flags=model.sync_flags,
            strategy=type(fitted.strategy).__name__,
            model_is_module=fitted.model is model,
            collectives=collectives(fitted.strategy),
        ),
    )


def fit_trainer_resumed(out: Path, run: str) -> None:
    first = trainer(ReplicateStrategy(), EPOCHS - 1)
    first.fit(Regression(), loader())
    checkpoint = out / "trainer.ckpt"
    first.save_checkpoint(checkpoint)
    model = Regression()  # a fresh module and Trainer, as a new job would have
    second = trainer(ReplicateStrategy(), EPOCHS)
    second.fit(model, loader(), ckpt_path=checkpoint)
    keys = list(torch.load(checkpoint, weights_only=False)["state_dict"])
    save(out, run, result(model, checkpoint_keys=keys))


def fabric_epochs(fabric: L.Fabric, model: nn.Module, optimizer: Any, epochs: range) -> list[bool]:
    """Trains with accumulation through ``fabric.no_backward_sync``; returns the sync flag at each backward."""
    batches = fabric.setup_dataloaders(loader(shuffle=False))
    flags = []
    for _ in epochs:
        for index, (x, y) in enumerate(batches):
            last_micro_batch = (index + 1) % ACCUMULATE == 0
            with fabric.no_backward_sync(model, enabled=not last_micro_batch):
                loss = nn.functional.mse_loss(model(x), y) / ACCUMULATE
                fabric.backward(loss)
                state = find_state(model.module)
                flags.append(state.requires_gradient_sync if state is not None else True)
            if last_micro_batch:
                optimizer.step()
                optimizer.zero_grad()
    return flags


def fabric_setup(strategy: Any) -> tuple[L.Fabric, nn.Module, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=DEVICES, strategy=strategy)
    fabric.launch()
    module = network()
    model, optimizer = fabric.setup(module, OPTIMIZER(module.parameters(), lr=0.05))
    return fabric, model, optimizer


def fit_fabric(out: Path, run: str, strategy: Callable[[], Any]) -> None:
    fabric, model, optimizer = fabric_setup(strategy())
    flags = fabric_epochs(fabric, model, optimizer, range(EPOCHS))
    extra = {"strategy": type(fabric.strategy).__name__, "collectives": collectives(fabric.strategy)}
    save(out, run, result(model.module, sync_flags=flags, **extra))


def fit_fabric_resumed(out: Path, run: str) -> None:
    fabric, model, optimizer = fabric_setup(FabricReplicateStrategy())
    fabric_epochs(fabric, model, optimizer, range(EPOCHS - 1))
    checkpoint = out / "fabric.ckpt"
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer})
    fabric, model, optimizer = fabric_setup(FabricReplicateStrategy())
    fabric.load(checkpoint, {"model": model, "optimizer": optimizer})
    fabric_epochs(fabric, model, optimizer, range(EPOCHS - 1, EPOCHS))
    save(out, run, result(model.module))


def refusal(out: Path, case: str, attempt: Callable[[], Any]) -> None:
    """Runs ``attempt``, which must raise; writes the message."""
    try:
        attempt()
    except Exception as error:  # noqa: BLE001  # the test reads the type and message
        message = f"{type(error).__name__}: {error}"
    else:
        message = "no error"
    (out / f"{case}.rank{dist.get_rank()}.txt").write_text(message)


def main(out: Path, averaging_only: bool = False) -> None:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # a 4-batch loader, on purpose
    torch.set_num_threads(1)
    if averaging_only:
        global OPTIMIZER
        OPTIMIZER = torch.optim.SGD
        fit_trainer(out, "trainer_ddp", lambda: "ddp")
        fit_trainer(out, "trainer_replicate", lambda: ReplicateStrategy(bucket_cap_mb=25))
        fit_fabric(out, "fabric_ddp", lambda: "ddp")
        fit_fabric(out, "fabric_replicate", FabricReplicateStrategy)
        dist.barrier()
        return
    fit_trainer(out, "trainer_ddp", lambda: "ddp")
    fit_trainer(out, "trainer_replicate_by_name", lambda: "replicate")
    fit_trainer(out, "trainer_replicate", lambda: ReplicateStrategy(bucket_cap_mb=25))
    fit_trainer_resumed(out, "trainer_replicate_resumed")
    fit_fabric(out, "fabric_ddp", lambda: "ddp")
    fit_fabric(out, "fabric_replicate_by_name", lambda: "replicate")
    fit_fabric(out, "fabric_replicate", FabricReplicateStrategy)
    fit_fabric_resumed(out, "fabric_replicate_resumed")
    refusal(
        out, "trainer_replicated_module", lambda: trainer(ReplicateStrategy(), 1).fit(replicate(Regression()), loader())
    )
    fabric = L.Fabric(accelerator="cpu", devices=DEVICES, strategy="replicate")
    fabric.launch()
    refusal(out, "fabric_replicated_module", lambda: fabric.setup(replicate(network())))
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), averaging_only="--averaging" in sys.argv[2:])
