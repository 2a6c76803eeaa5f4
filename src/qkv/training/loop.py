"""The training loop: the book's chapter-5 loop, with what a real run needs around it.

Per step: a batch of windows, cross-entropy of the next token, backward, gradient
clipping, AdamW, a warmup + cosine learning rate. Every `eval_every` steps: train and
validation loss on fixed windows, a greedy sample of a fixed prompt, one line in
metrics.jsonl. Every `save_every` steps and at the end: an atomic checkpoint and the
model folder. Under torchrun the model is wrapped in DistributedDataParallel and each
process trains on its slice of the same global batch; only rank 0 prints and writes.
With `context_parallel` every process takes the whole batch instead and holds a shard of
each window (ring attention, qkv.models.context_parallel); the gradients of the shards
are summed over the processes, so the run equals one process with the same batch.

Shape legend: B batch (per process), L window length, V vocabulary.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from qkv.errors import QkvError
from qkv.models.context_parallel import ContextParallel, join_context_parallel, sharded_forward
from qkv.models.gpt2 import GPT2Decoder
from qkv.models.hf.gpt2_tokenizer import gpt2_tokenizer
from qkv.util.progress import progress_bar, slow_step
from qkv.util.terminal_text import escape_controls
from qkv.training.checkpoint import (
    TrainingState,
    checkpoint_path,
    load_checkpoint,
    read_state,
    restore_modules,
    save_checkpoint,
)
from qkv.training.data import (
    MAX_BPE_CHARACTERS,
    WHEN_EMPTY,
    BatchSchedule,
    CorpusText,
    FileWindows,
    announce_corpus,
    require_windows,
    scan_corpus,
    tokenize_corpus,
)
from qkv.training.distributed import DistContext, init_distributed, shutdown_distributed
from qkv.training.failed_start import disk_full, disk_full_message, is_empty_folder, missing_folders, remove_if_empty
from qkv.training.export import TOKENIZER_NAME, export_model_folder, write_tokenizer
from qkv.training.metrics import METRICS_NAME, PLOT_NAME, MetricsLog, plot_losses
from qkv.training.outdir import OutputFolder
from qkv.training.presets import PRESETS
from qkv.training.sample import greedy_continuation
from qkv.training.schedule import warmup_cosine
from qkv.training.book.run import BookRun  # the book's train_model_simple
from qkv.training.result import TrainResult
from qkv.training.settings import TrainSettings, model_config
from qkv.training.tokenizer import END_OF_TEXT, load_tokenizer, train_bpe_from

# Settings a resumed run may change: they do not alter the trajectory of the weights.
RESUMABLE_CHANGES = frozenset(
    {"data", "out", "epochs", "max_steps", "eval_every", "save_every", "eval_windows",
     "sample_prompt", "sample_tokens", "tokenizer"}
)


def train(
    settings: TrainSettings,
    *,
    resume: bool = False,
    overwrite: bool = False,
    on_step: Callable[[int], None] | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train (or, with `resume`, continue) the run that `settings` describe.

    The output folder is claimed and locked first (qkv.training.outdir); `overwrite`
    lets a run start in a folder that holds other files or an earlier run.
    `on_step(step)` is called after every completed step (and any evaluation or
    checkpoint at that step); raising KeyboardInterrupt from it stops the run as
    Ctrl-C would.
    """
    ctx = init_distributed(group_even_alone=settings.context_parallel and "WORLD_SIZE" in os.environ)
    folder = OutputFolder(settings.out)
    created = missing_folders(folder.path.absolute())
    was_empty = is_empty_folder(folder.path)
    run: Any = None  # _Run or BookRun
    try:
        if ctx.is_main:  # only rank 0 writes
            folder.claim(resume=resume, overwrite=overwrite, settings=settings.to_dict())
        try:
            if PRESETS[settings.preset].loop == "book":

                run = BookRun(settings, ctx, resume=resume, progress=progress)
            else:
                run = _Run(settings, ctx, resume=resume, progress=progress)
            if ctx.is_main:
                folder.note_model(run.config.to_dict())
        except BaseException:
            if (created or was_empty) and ctx.is_main:  # bad input found before anything but the claim was written
                folder.forget()
                remove_if_empty(created)
            raise
        return run.fit(on_step)
    except Exception as error:
        if not disk_full(error):
            raise
        raise QkvError(
            f"{disk_full_message(error, settings.out)}; free some space and "
            "run again with --resume: every file qkv writes is replaced whole, so the last checkpoint is intact"
        ) from None
    finally:
        folder.release()
        del run  # DDP's reducer must go while the process group lives: see shutdown_distributed
        shutdown_distributed(ctx)


def saved_settings(out: str | Path) -> TrainSettings:
    """The settings of the run in `out` (for --resume): its checkpoint's, or, for a run that
    ended before its first checkpoint, the ones it recorded when it started."""
    if not checkpoint_path(out).exists():
        recorded = OutputFolder(out).run_settings()
        if recorded is not None:
            return TrainSettings.from_dict(recorded)
    return TrainSettings.from_dict(read_state(checkpoint_path(out)).settings)


class _Run:
    def __init__(self, settings: TrainSettings, ctx: DistContext, *, resume: bool, progress: bool) -> None:
        self.ctx = ctx
        self.settings = settings
        self.out = Path(settings.out)
        self.progress = progress
        # Context parallel: one data-parallel replica, its windows sharded over every process.
        self.cp: ContextParallel | None = join_context_parallel() if settings.context_parallel else None
        self.data_world, self.data_rank = (1, 0) if self.cp is not None else (ctx.world_size, ctx.rank)
        self._prepare(resume)

    def _prepare(self, resume: bool) -> None:
        settings, ctx = self.settings, self.ctx
        has_checkpoint = resume and checkpoint_path(self.out).exists()  # else: the run starts over
        self.checkpoint = load_checkpoint(checkpoint_path(self.out)) if has_checkpoint else None

        if ctx.is_main:
            announce_corpus(settings.data)
        with slow_step(f"reading {settings.data}") if ctx.is_main else contextlib.nullcontext():
            corpus = scan_corpus(settings.data, when_empty=WHEN_EMPTY)  # streamed: qkv.training.data
        fingerprint = corpus.fingerprint
        self.tokenizer = self._tokenizer(corpus)
        token_folder = self.out if self.out.is_dir() else None  # rank 0 made it; a temporary folder until then
        train_ids, val_ids = tokenize_corpus(corpus, self.tokenizer, token_folder, progress=ctx.is_main and self.progress)
        length = settings.context_length
        self.train_windows = FileWindows(train_ids, length, settings.stride)
        self.val_windows = FileWindows(val_ids, length, settings.stride)
        require_windows(self.train_windows, "training", len(train_ids))
        require_windows(self.val_windows, "validation", len(val_ids))
        self.batches = BatchSchedule(
            len(self.train_windows), settings.batch_size, self.data_world, settings.seed
        )
        if self.checkpoint is None and ctx.is_main:  # the input is usable: start writing
            write_tokenizer(self.tokenizer, self.out / TOKENIZER_NAME)
        self.total_steps = settings.max_steps or settings.epochs * self.batches.steps_per_epoch

        self.config = model_config(settings, self.tokenizer.get_vocab_size())
        torch.manual_seed(settings.seed)
        self.model = GPT2Decoder(self.config).to(ctx.device)
        self.optimizer = _adamw(self.model, settings)
        self.scheduler = warmup_cosine(
            self.optimizer, warmup_steps=settings.warmup_steps, total_steps=self.total_steps,
            min_ratio=settings.min_lr_ratio,
        )
        torch.manual_seed(settings.seed + ctx.rank)  # each process its own dropout stream
        self.metrics = MetricsLog(self.out / METRICS_NAME)
        self.step = 0
        self.tokens_seen = 0
        if self.checkpoint is None and ctx.is_main:
            self.metrics.keep_until(-1)  # lines left by a run that never saved a checkpoint
        self.state_base = dict(
            settings=settings.to_dict(), model_config=self.config.to_dict(),
            data_fingerprint=fingerprint,
        )
        if self.checkpoint is not None:
            self._restore(fingerprint)
            self.checkpoint = None  # its tensors now live in the model and optimizer
        self.ddp: nn.Module = (
            DistributedDataParallel(
                self.model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None
            )
            if ctx.distributed and self.cp is None else self.model
        )

    # -- set-up -----------------------------------------------------------------------

    def _tokenizer(self, corpus: CorpusText) -> Tokenizer:
        """The checkpoint's tokenizer, the given one, GPT-2's (the book presets), or a BPE
        that rank 0 trains and shares."""
        if self.checkpoint is not None:
            return load_tokenizer(self.out / TOKENIZER_NAME)
        if self.settings.tokenizer is not None:
            return load_tokenizer(self.settings.tokenizer)
        if PRESETS[self.settings.preset].tokenizer == "gpt2":
            return gpt2_tokenizer()
        trained = None
        if self.ctx.is_main:
            sample = (f"the first {MAX_BPE_CHARACTERS:,} characters of the training split (--tokenizer gives another)"
                      if corpus.sampled_for_bpe else "the training split")
            with slow_step(f"training a {self.settings.vocab_size}-entry BPE tokenizer on {sample}",
                           after=0 if corpus.sampled_for_bpe else None):
                trained = train_bpe_from(corpus.bpe_sample(), self.settings.vocab_size).to_str()
        return Tokenizer.from_str(self.ctx.broadcast_object(trained))

    def _restore(self, fingerprint: str) -> None:
        ckpt = self.checkpoint
        if ckpt is None:
            raise RuntimeError("_restore needs a loaded checkpoint")
        path = checkpoint_path(self.out)
        saved = TrainSettings.from_dict(ckpt.state.settings)
        changed = {
            k: (getattr(saved, k), getattr(self.settings, k))
            for k in saved.to_dict()
            if k not in RESUMABLE_CHANGES and getattr(saved, k) != getattr(self.settings, k)
        }
        if changed:
            name, (old, new) = next(iter(changed.items()))
            raise QkvError(
                f"--resume must keep the run's settings: {name} was {old!r}, now {new!r}; "
                "drop that option when resuming"
            )
        if ckpt.state.data_fingerprint != fingerprint:
            raise QkvError(f"{self.settings.data} is not the text this run was trained on; resume with that file")
        if ckpt.state.world_size != self.ctx.world_size:
            raise QkvError(
                f"the checkpoint was written by {ckpt.state.world_size} processes; resume with "
                f"the same number (torchrun --nproc_per_node {ckpt.state.world_size})"
            )
        if ckpt.state.model_config != self.config.to_dict():
            raise QkvError(f"checkpoint {path} holds a different model shape than these settings make")
        done = ckpt.state.step
        if done > self.total_steps:
            raise QkvError(
                f"{self.out} has already trained {done} steps, more than the {self.total_steps} "
                f"{_length(self.settings)} asks for; give a larger one to extend the run"
            )
        restore_modules(ckpt, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, path=path)
        # A changed --max-steps/--epochs: the rest of the decay starts from the current rate.
        self.scheduler.lr_lambdas[0].replan(done, self.total_steps)
        torch.set_rng_state(ckpt.rng_cpu[self.ctx.rank])
        cuda_state = ckpt.rng_cuda[self.ctx.rank]
        if cuda_state is not None and self.ctx.device.type == "cuda":
            torch.cuda.set_rng_state(cuda_state, self.ctx.device)
        self.step = ckpt.state.step
        self.tokens_seen = ckpt.state.tokens_seen
        if self.ctx.is_main:
            self.metrics.keep_until(self.step)

    # -- the loop -----------------------------------------------------------------------

    def fit(self, on_step: Callable[[int], None] | None) -> TrainResult:
        s, ctx = self.settings, self.ctx
        start = time.perf_counter()
        if self.step >= self.total_steps:
            if ctx.is_main:
                print(
                    f"{self.out} is already complete: {self.step} of {self.total_steps} steps "
                    f"({_length(s)}), nothing to train. To train longer, resume with a larger "
                    "--epochs or --max-steps; the added steps continue from the current learning rate "
                    "(see qkv train --help)."
                )
            return TrainResult(self.out, self.step, self.tokens_seen, self.metrics.read() if ctx.is_main else [], 0.0)
        if self.step == 0:
            self._evaluate()
        bar = progress_bar(
            total=self.total_steps, initial=self.step, desc="train", unit="step",
            enabled=ctx.is_main and self.progress,
        )
        train_seconds, run_tokens = 0.0, 0
        permutation_epoch, permutation = -1, torch.empty(0)
        tokens_per_step = self.batches.global_batch * s.context_length
        try:
            with bar:
                while self.step < self.total_steps:
                    epoch, _ = self.batches.position(self.step)
                    if epoch != permutation_epoch:
                        permutation_epoch, permutation = epoch, self.batches.permutation(epoch)
                    t0 = time.perf_counter()
                    loss = self._train_step(self.batches.indices(self.step, self.data_rank, permutation))
                    train_seconds += time.perf_counter() - t0
                    self.step += 1
                    self.tokens_seen += tokens_per_step
                    run_tokens += tokens_per_step
                    bar.update(1)
                    bar.set_postfix(
                        loss=f"{loss:.3f}", tok_s=f"{run_tokens / max(train_seconds, 1e-9):,.0f}",
                        refresh=False,
                    )
                    last = self.step == self.total_steps
                    if self.step % s.eval_every == 0 or last:
                        self._evaluate(write=bar.write)
                    if self.step % s.save_every == 0 or last:
                        self._save()
                    if on_step is not None:
                        on_step(self.step)
        except KeyboardInterrupt:
            if ctx.is_main:
                print(
                    f"interrupted at step {self.step}; {checkpoint_path(self.out)} keeps the last "
                    "saved step; continue with --resume",
                    file=sys.stderr,
                )
            raise
        records = self.metrics.read() if ctx.is_main else []
        if ctx.is_main and records:
            plot_losses(records, self.out / PLOT_NAME, title=f"qkv train --preset {s.preset}")
        seconds = time.perf_counter() - start
        if ctx.is_main and records:
            print(
                f"{self.step} steps, {self.tokens_seen:,} tokens in {seconds:.1f} s; validation loss "
                f"{records[0]['val_loss']:.3f} -> {records[-1]['val_loss']:.3f}; model in {self.out}"
            )
        return TrainResult(self.out, self.step, self.tokens_seen, records, seconds)

    def _train_step(self, index: Tensor) -> float:
        inputs, targets = self.train_windows.batch(index)  # (B, L) each
        inputs, targets = inputs.to(self.ctx.device), targets.to(self.ctx.device)
        if self.cp is not None:
            return self._context_parallel_step(inputs, targets, self.cp)
        with self._autocast():
            logits = self.ddp(inputs)  # (B, L, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.settings.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return self.ctx.all_mean(loss.item())

    def _context_parallel_step(self, inputs: Tensor, targets: Tensor, cp: ContextParallel) -> float:
        """One step on this rank's shard of every window: the mean loss over the whole batch is
        the sum of the shards' summed losses over all tokens, and so is its gradient."""
        with self._autocast():
            part = sharded_forward(self.model, inputs, cp)  # logits (B, L_rank, V)
        mine = part.ring.layout.shard(targets, part.ring.rank, dim=1)  # (B, L_rank)
        loss_sum = F.cross_entropy(part.logits.flatten(0, 1).float(), mine.flatten(), reduction="sum")
        self.optimizer.zero_grad(set_to_none=True)
        (loss_sum / targets.numel()).backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
        totals = torch.cat([flat, loss_sum.detach().reshape(1)])
        if cp.group is not None:
            dist.all_reduce(totals, group=cp.group)  # every shard's share, on every rank
        for p, g in zip(params, totals[:-1].split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))  # type: ignore[union-attr]
        if self.settings.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return totals[-1].item() / targets.numel()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.settings.dtype == "bfloat16":
            return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def _mean_loss(self, windows: FileWindows) -> float:
        """Mean next-token loss over the first eval_windows windows, shared by all ranks."""
        n = min(len(windows), self.settings.eval_windows)
        mine = torch.arange(self.ctx.rank, n, self.ctx.world_size)  # this rank's windows
        total = torch.zeros(2, dtype=torch.float64)  # (sum of window losses, windows)
        self.model.eval()
        for chunk in mine.split(self.settings.batch_size):
            inputs, targets = windows.batch(chunk)  # (B, L) each
            inputs, targets = inputs.to(self.ctx.device), targets.to(self.ctx.device)
            with self._autocast():
                logits = self.model(inputs)  # (B, L, V)
            per_token = F.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), reduction="none"
            ).view(targets.shape)  # (B, L)
            total[0] += per_token.mean(dim=1).sum().item()
            total[1] += len(chunk)
        self.model.train()
        total = self.ctx.all_sum(total).cpu()
        return (total[0] / total[1]).item()

    def _evaluate(self, write: Callable[[str], None] = print) -> None:
        train_loss = self._mean_loss(self.train_windows)
        val_loss = self._mean_loss(self.val_windows)
        if not self.ctx.is_main:
            return
        sample = greedy_continuation(
            self.model, self.tokenizer, self.settings.sample_prompt,
            max_new_tokens=self.settings.sample_tokens, device=self.ctx.device,
            eos_token_id=self.tokenizer.token_to_id(END_OF_TEXT),
        )
        record = {
            "step": self.step, "tokens_seen": self.tokens_seen, "train_loss": train_loss,
            "val_loss": val_loss, "lr": self.scheduler.get_last_lr()[0], "sample": sample,
        }
        self.metrics.append(record)
        write(
            f"step {self.step:>6}  tokens {self.tokens_seen:>10,}  train loss {train_loss:.3f}  "
            f"val loss {val_loss:.3f}  | "
            + escape_controls((self.settings.sample_prompt + sample).replace("\n", "\\n"))  # the model's text
        )

    def _save(self) -> None:
        rng_cpu = self.ctx.gather_objects(torch.get_rng_state())
        cuda = torch.cuda.get_rng_state(self.ctx.device) if self.ctx.device.type == "cuda" else None
        rng_cuda = self.ctx.gather_objects(None if cuda is None else cuda.cpu())
        if not self.ctx.is_main:
            return
        epoch, batch_in_epoch = self.batches.position(self.step)
        state = TrainingState(
            step=self.step, tokens_seen=self.tokens_seen, epoch=epoch,
            batch_in_epoch=batch_in_epoch, world_size=self.ctx.world_size, **self.state_base,
        )
        export_model_folder(self.model, self.tokenizer, self.out)
        save_checkpoint(
            checkpoint_path(self.out), state=state, model=self.model, optimizer=self.optimizer,
            scheduler=self.scheduler, rng_cpu=rng_cpu, rng_cuda=rng_cuda,
        )


def _length(settings: TrainSettings) -> str:
    """The run's length as the user set it: "--epochs 16" or "--max-steps 300"."""
    return f"--max-steps {settings.max_steps}" if settings.max_steps else f"--epochs {settings.epochs}"


def _adamw(model: nn.Module, settings: TrainSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norms' scale and shift)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
    )
