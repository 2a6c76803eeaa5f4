"""Checkpoints: a restored model and optimizer continue exactly; bad files are QkvErrors;
an interrupted write leaves the previous checkpoint whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qkv.errors import QkvError
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.util.atomic import atomic_write_with
from qkv.training.checkpoint import TrainingState, load_checkpoint, restore_modules, save_checkpoint
from qkv.training.loop import _adamw
from qkv.training.schedule import warmup_cosine
from qkv.training.settings import TrainSettings

CFG = GPTConfig(vocab_size=50, context_length=8, emb_dim=16, n_heads=2, n_layers=2, drop_rate=0.1)


def parts(seed: int):
    torch.manual_seed(seed)
    model = GPT2Decoder(CFG)
    settings = TrainSettings(data="d", out="o", max_steps=10, epochs=None, weight_decay=0.1)
    optimizer = _adamw(model, settings)
    scheduler = warmup_cosine(optimizer, warmup_steps=2, total_steps=10, min_ratio=0.1)
    return model, optimizer, scheduler, settings


def step(model, optimizer, scheduler) -> float:
    x = torch.randint(0, 50, (2, 8))
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


def save(path: Path, model, optimizer, scheduler, settings, *, step_no: int = 3) -> None:
    state = TrainingState(
        step=step_no, tokens_seen=48, epoch=0, batch_in_epoch=step_no, world_size=1,
        settings=settings.to_dict(), model_config=CFG.to_dict(), data_fingerprint="x",
    )
    save_checkpoint(
        path, state=state, model=model, optimizer=optimizer, scheduler=scheduler,
        rng_cpu=[torch.get_rng_state()], rng_cuda=[None],
    )


def test_restored_training_continues_bitwise(tmp_path: Path) -> None:
    model, optimizer, scheduler, settings = parts(0)
    for _ in range(3):
        step(model, optimizer, scheduler)
    path = tmp_path / "checkpoint.safetensors"
    save(path, model, optimizer, scheduler, settings)
    expected = [step(model, optimizer, scheduler) for _ in range(3)]  # dropout + data from the RNG

    fresh, fresh_opt, fresh_sched, _ = parts(1)
    checkpoint = load_checkpoint(path)
    restore_modules(checkpoint, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, path=path)
    torch.set_rng_state(checkpoint.rng_cpu[0])
    assert checkpoint.state.step == 3 and checkpoint.state.settings == settings.to_dict()
    assert [step(fresh, fresh_opt, fresh_sched) for _ in range(3)] == expected
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert fresh_sched.get_last_lr() == scheduler.get_last_lr()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_checkpoint_is_a_clear_error(tmp_path: Path, damage: str) -> None:
    model, optimizer, scheduler, settings = parts(0)
    path = tmp_path / "checkpoint.safetensors"
    save(path, model, optimizer, scheduler, settings)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x07" * 64, "empty": b""}[damage])
    with pytest.raises(QkvError, match="corrupt"):
        load_checkpoint(path)


def test_missing_checkpoint_says_how_to_start(tmp_path: Path) -> None:
    with pytest.raises(QkvError, match="without --resume"):
        load_checkpoint(tmp_path / "checkpoint.safetensors")


def test_interrupted_write_keeps_the_previous_file(tmp_path: Path) -> None:
    model, optimizer, scheduler, settings = parts(0)
    path = tmp_path / "checkpoint.safetensors"
    save(path, model, optimizer, scheduler, settings)
    before = path.read_bytes()

    def half_then_ctrl_c(tmp: str) -> None:
        Path(tmp).write_bytes(before[:100])
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write_with(path, half_then_ctrl_c)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind
    assert load_checkpoint(path).state.step == 3
