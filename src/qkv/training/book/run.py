"""`qkv train --preset book`: the book's chapter-5 run (`train_model_simple`), step for step.

The run makes the same calls as the book's notebook, in the same order, so that it draws
the same random numbers: GPT-2's tokens of the text split at 90% of its characters;
windows of context_length tokens every `stride` (GPTDatasetV1); a torch DataLoader over
them with shuffle and drop_last for training and neither for validation;
`torch.manual_seed(seed)` and then the book's GPTModel (qkv.book.gpt), whose dropout
masks are drawn in the book's order; AdamW on every parameter. Every step: zero_grad,
the mean cross-entropy, backward, the optimizer step; the step counter starts at -1, so
step 0 is evaluated after the first update. Each evaluation, as the book's
calc_loss_loader, averages the loss of the first `eval_windows // batch_size` batches of
a fresh pass over each loader: for the shuffled training loader a fresh order, which
draws from the global generator exactly as the book's does. After each epoch, 50 greedy
tokens (sample_tokens) of the start context with generate_text_simple. Lines are printed in the book's
format ("Ep 1 (Step 000000): Train loss 9.817, Val loss 9.924").

The qkv run's own options are honoured too (--max-steps, --warmup-steps and
--min-lr-ratio through the same schedule as qkv's loop, which is a constant 1.0 for the
book's values; --dtype bfloat16 autocast; --save-every; a given --tokenizer). What the
book's run has no place for is refused: --resume (no optimizer state is kept: the folder
holds the final weights, 0.65 GB for the book's model, where the book's
model_and_optimizer.pth with AdamW's two moments would be 1.9 GB), torchrun and
--context-parallel.

Shape legend: B batch, L window length (context_length), V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from qkv.book.gpt import GPTModel, generate_text_simple, to_qkv
from qkv.errors import QkvError
from qkv.models.hf.gpt2_tokenizer import gpt2_tokenizer
from qkv.training.data import (
    WHEN_EMPTY,
    FileWindows,
    announce_corpus,
    require_windows,
    scan_corpus,
    tokenize_corpus,
)
from qkv.training.distributed import DistContext
from qkv.training.export import TOKENIZER_NAME, export_model_folder, write_tokenizer
from qkv.training.book.figure import plot_book_losses
from qkv.training.metrics import METRICS_NAME, PLOT_NAME, MetricsLog
from qkv.training.schedule import WarmupCosine
from qkv.training.result import TrainResult
from qkv.training.settings import TrainSettings, model_config
from qkv.training.tokenizer import load_tokenizer


class WindowDataset(Dataset[tuple[Tensor, Tensor]]):
    """GPTDatasetV1's (input, target) pairs: window i is ids[i*stride : i*stride + L (+1)]."""

    def __init__(self, windows: FileWindows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        row = self.windows.row(index)  # (L + 1,)
        return row[:-1], row[1:]  # input (L,), target (L,)


def calc_loss_batch(model: GPTModel, inputs: Tensor, targets: Tensor) -> Tensor:
    logits = model(inputs)  # (B, L, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def calc_loss_loader(loader: DataLoader[Any], model: GPTModel, num_batches: int, autocast: Any) -> float:
    """The mean loss of the first `num_batches` batches of a fresh pass over `loader`."""
    if len(loader) == 0:
        return float("nan")
    num_batches = min(num_batches, len(loader))
    total = 0.0
    for i, (inputs, targets) in enumerate(loader):  # a fresh iterator: the book's RNG draws
        if i >= num_batches:
            break
        with autocast():
            total += calc_loss_batch(model, inputs, targets).item()
    return total / num_batches


class StepInBackward:
    """The book's AdamW, one optimizer per parameter, each stepped as soon as its parameter's
    gradient is complete (a post-accumulate-grad hook) and the gradient then dropped.

    The arithmetic is the book's: torch's AdamW updates every parameter on its own (its
    per-tensor loop on CPU), so splitting it per parameter changes no number; the update
    only happens earlier, once backward is done with that parameter (each is used once in
    the forward pass). What it saves is memory: the gradients of all 163M parameters never
    exist at once (0.65 GB). With gradient clipping, which needs every gradient first, the
    step waits for `step()` as usual.
    """

    def __init__(self, model: torch.nn.Module, *, lr: float, weight_decay: float, in_backward: bool) -> None:
        self.lr = lr
        self.in_backward = in_backward
        self.optimizers = [torch.optim.AdamW([p], lr=lr, weight_decay=weight_decay) for p in model.parameters()]
        self.handles = []
        if in_backward:
            for p, optimizer in zip(model.parameters(), self.optimizers):
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook(optimizer)))

    @staticmethod
    def _hook(optimizer: torch.optim.Optimizer) -> Callable[[Tensor], None]:
        def step(_: Tensor) -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        for optimizer in self.optimizers:
            optimizer.param_groups[0]["lr"] = lr

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        if not self.in_backward:
            for optimizer in self.optimizers:
                optimizer.step()

    def forget(self) -> None:
        """Drop the moments and the hooks (the run is over)."""
        for handle in self.handles:
            handle.remove()
        for optimizer in self.optimizers:
            optimizer.state.clear()


class BookRun:
    """One `train_model_simple` run with a qkv output folder (see the module docstring)."""

    def __init__(self, settings: TrainSettings, ctx: DistContext, *, resume: bool, progress: bool) -> None:
        del progress  # the book prints its lines and nothing else
        if resume:
            raise QkvError(
                "--preset book keeps no optimizer state, so it cannot --resume; start it again "
                "(--overwrite), or use --preset book-124m for a run that resumes"
            )
        if ctx.distributed or settings.context_parallel:
            raise QkvError("--preset book is the book's one-process run; use --preset book-124m under torchrun")
        self.settings, self.ctx = settings, ctx
        self.out = Path(settings.out)
        announce_corpus(settings.data)
        corpus = scan_corpus(settings.data, when_empty=WHEN_EMPTY)  # streamed: qkv.training.data
        self.tokenizer = self._tokenizer()
        train_ids, val_ids = tokenize_corpus(corpus, self.tokenizer, self.out if self.out.is_dir() else None,
                                             progress=False)
        length = settings.context_length
        train_windows = FileWindows(train_ids, length, settings.stride)
        val_windows = FileWindows(val_ids, length, settings.stride)
        require_windows(train_windows, "training", len(train_ids))
        require_windows(val_windows, "validation", len(val_ids))
        self.train_loader = DataLoader(WindowDataset(train_windows), batch_size=settings.batch_size,
                                       shuffle=True, drop_last=True, num_workers=0)
        self.val_loader = DataLoader(WindowDataset(val_windows), batch_size=settings.batch_size,
                                     shuffle=False, drop_last=False, num_workers=0)
        if len(self.train_loader) == 0:
            raise QkvError(
                f"the training split has {len(train_windows)} windows, fewer than one batch of "
                f"{settings.batch_size}; lower --batch-size or --context-length, or use more text"
            )
        self.steps_per_epoch = len(self.train_loader)
        self.total_steps = settings.max_steps or settings.epochs * self.steps_per_epoch
        self.eval_batches = max(1, settings.eval_windows // settings.batch_size)
        self.config = model_config(settings, self.tokenizer.get_vocab_size())
        write_tokenizer(self.tokenizer, self.out / TOKENIZER_NAME)
        torch.manual_seed(settings.seed)  # the book: right before GPTModel(GPT_CONFIG_124M)
        self.model = GPTModel(self.config).to(ctx.device)
        self.schedule = WarmupCosine(settings.warmup_steps, self.total_steps, settings.min_lr_ratio)
        # The book's values (no warmup, floor 1.0) keep every rate exactly lr.
        self.optimizer = StepInBackward(self.model, lr=settings.lr, weight_decay=settings.weight_decay,
                                        in_backward=settings.grad_clip is None)
        self.metrics = MetricsLog(self.out / METRICS_NAME)
        self.metrics.keep_until(-1)

    def _tokenizer(self) -> Tokenizer:
        if self.settings.tokenizer is not None:
            return load_tokenizer(self.settings.tokenizer)
        return gpt2_tokenizer()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.settings.dtype == "bfloat16":
            return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def fit(self, on_step: Callable[[int], None] | None) -> TrainResult:
        s = self.settings
        start = time.perf_counter()
        tokens_seen, global_step, done = 0, -1, 0
        records: list[dict[str, Any]] = []
        epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        for epoch in range(epochs):
            self.model.train()
            for inputs, targets in self.train_loader:
                if done == self.total_steps:
                    break
                inputs, targets = inputs.to(self.ctx.device), targets.to(self.ctx.device)
                self.optimizer.set_lr(s.lr * self.schedule(done))
                self.optimizer.zero_grad()
                with self._autocast():
                    loss = calc_loss_batch(self.model, inputs, targets)
                loss.backward()  # with in_backward, each parameter is updated as its gradient completes
                if s.grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.grad_clip)
                self.optimizer.step()
                tokens_seen += inputs.numel()
                global_step += 1
                done += 1
                if global_step % s.eval_every == 0:
                    records.append(self._evaluate(epoch, global_step, tokens_seen))
                if done % s.save_every == 0 and done < self.total_steps:
                    self._save()
                if on_step is not None:
                    on_step(done)
            sample = self._sample()
            print(sample.replace("\n", " "), flush=True)  # generate_and_print_sample's compact line
            self.metrics.append({"epoch": epoch + 1, "after_step": global_step, "sample": sample})
        seconds = time.perf_counter() - start  # the book's train_model_simple ends here
        self.optimizer.forget()  # AdamW's moments (twice the model) are not kept: room to save
        self._save()
        if records:
            plot_book_losses(records, s.epochs if s.max_steps is None else done / self.steps_per_epoch,
                             self.out / PLOT_NAME)
        print(f"{done} steps, {tokens_seen:,} tokens in {seconds:.1f} s (saving the model took "
              f"{time.perf_counter() - start - seconds:.1f} s more); model in {self.out}", flush=True)
        return TrainResult(self.out, done, tokens_seen, records, seconds)

    def _evaluate(self, epoch: int, step: int, tokens_seen: int) -> dict[str, Any]:
        self.model.eval()
        with torch.no_grad():
            train_loss = calc_loss_loader(self.train_loader, self.model, self.eval_batches, self._autocast)
            val_loss = calc_loss_loader(self.val_loader, self.model, self.eval_batches, self._autocast)
        self.model.train()
        print(f"Ep {epoch + 1} (Step {step:06d}): Train loss {train_loss:.3f}, Val loss {val_loss:.3f}", flush=True)
        record = {"step": step, "epoch": epoch + 1, "tokens_seen": tokens_seen, "train_loss": train_loss,
                  "val_loss": val_loss, "lr": self.optimizer.lr}
        self.metrics.append(record)
        return record

    def _sample(self) -> str:
        """The start context and 50 greedy tokens (generate_text_simple, window cropped)."""
        self.model.eval()
        ids = self.tokenizer.encode(self.settings.sample_prompt, add_special_tokens=False).ids
        prompt = torch.tensor([ids], dtype=torch.long, device=self.ctx.device)  # (1, T)
        with torch.no_grad(), self._autocast():
            out = generate_text_simple(self.model, prompt, self.settings.sample_tokens, self.config.context_length)
        self.model.train()
        return self.tokenizer.decode(out[0].tolist())

    def _save(self) -> None:
        """The model folder (Hugging Face GPT-2 layout, untied head, float32): no optimizer state."""
        export_model_folder(to_qkv(self.model), self.tokenizer, self.out)


__all__ = ["BookRun", "WindowDataset", "calc_loss_loader"]
