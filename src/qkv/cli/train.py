"""`qkv train`: train the book's GPT on a text file, on one process or many (torchrun).

Options left unset take the preset's value; with --resume they take the checkpoint's,
and only the length of the run (--epochs/--max-steps), --eval-every and --save-every may
change.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from qkv.cli.numbers import integer, number, seed
from qkv.errors import QkvError
from qkv.training.presets import PRESETS
from qkv.training.settings import TrainSettings
from qkv.training.presets import DEFAULT_PRESET
from qkv.training.settings import DTYPES
from qkv.util.threads import add_threads_argument, apply_threads

# Options that map one-to-one onto TrainSettings fields (None = not given).
_OVERRIDES = (
    "context_length", "stride", "batch_size", "epochs", "max_steps", "lr", "min_lr_ratio", "weight_decay",
    "warmup_steps", "eval_every", "save_every", "seed", "tokenizer", "dtype", "dropout", "preset",
    "emb_dim", "n_layers", "n_heads",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        description="Train the book's GPT (chapter 5) on a text file: byte-level BPE (GPT-2's for "
        "the book presets), sliding windows with a 90/10 split, AdamW with warmup and cosine decay, "
        "evaluations with a sample, metrics.jsonl, loss.png and atomic checkpoints. OUT becomes a "
        "model folder that `qkv generate --model OUT` loads. --preset book is the book's own "
        "train_model_simple run, printed in the book's format (no checkpoint: the final weights). "
        "Run it under `torchrun --nproc_per_node N -m qkv train ...` to train on N processes (the "
        "global batch is N x --batch-size).",
    )
    parser.add_argument("--data", required=True, metavar="FILE.txt", help="UTF-8 text to train on")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (model, checkpoint, metrics)")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS),
        help=f"model size and training defaults (default: {DEFAULT_PRESET})",
    )
    parser.add_argument("--context-length", type=integer(1, 2**20), metavar="N", help="window length in tokens (default: preset's)")
    parser.add_argument(
        "--stride", type=integer(1, 2**20), metavar="N", help="tokens between window starts (default: context length)"
    )
    parser.add_argument("--emb-dim", type=integer(1, 2**16), metavar="C", help="model width (default: preset's)")
    parser.add_argument("--n-layers", type=integer(1, 1024), metavar="N", help="transformer blocks (default: preset's)")
    parser.add_argument("--n-heads", type=integer(1, 2**12), metavar="H", help="attention heads, dividing --emb-dim (default: preset's)")
    parser.add_argument("--batch-size", type=integer(1, 2**16), metavar="N", help="windows per step per process (default: preset's)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=integer(1, 10**6), metavar="N", help="passes over the training windows (default: preset's)")
    length.add_argument("--max-steps", type=integer(1, 10**9), metavar="N", help="optimizer steps to train (instead of --epochs)")
    parser.add_argument("--lr", type=number(0.0, 10.0, exclusive_minimum=True), metavar="X", help="peak learning rate (default: preset's)")
    parser.add_argument(
        "--min-lr-ratio", type=number(0.0, 1.0), metavar="X",
        help="the cosine decay ends at --lr x X; 1 turns the decay off (default: preset's: 0.1, "
        "the book preset's 1, a constant rate)",
    )
    parser.add_argument("--weight-decay", type=number(0.0, 10.0), metavar="X", help="AdamW weight decay (default: preset's)")
    parser.add_argument(
        "--warmup-steps", type=integer(0, 10**9), metavar="N",
        help="linear warmup steps before cosine decay (default: preset's)",
    )
    parser.add_argument("--eval-every", type=integer(1, 10**9), metavar="N", help="steps between evaluations (default: preset's)")
    parser.add_argument("--save-every", type=integer(1, 10**9), metavar="N", help="steps between checkpoints (default: preset's)")
    parser.add_argument("--seed", type=seed, metavar="N", help="seed for weights, data order and dropout (default: 123)")
    parser.add_argument("--dropout", type=number(0.0, 0.999), metavar="P", help="dropout rate (default: preset's)")
    parser.add_argument("--tokenizer", metavar="tokenizer.json", help="use this tokenizer instead of training a BPE")
    parser.add_argument("--dtype", choices=DTYPES, help="float32, or bfloat16 autocast (default: float32)")
    add_threads_argument(parser)
    parser.add_argument("--resume", action="store_true",
                        help="continue the run whose checkpoint is in --out; with a larger --epochs or "
                        "--max-steps, extend it: the learning rate decays on from where it is to the "
                        "same floor at the new end (a finished run trains its added steps at the floor)")
    parser.add_argument(
        "--context-parallel", action="store_true",
        help="under torchrun, shard every window over the processes (ring attention) instead of "
        "splitting the batch: the global batch is --batch-size; needs --dropout 0",
    )
    parser.add_argument(
        "--overwrite", action="store_true",
        help="start the run even though --out holds other files or an earlier run: the files qkv "
        "writes there are replaced, model-folder files it would load beside them "
        "(generation_config.json, tokenizer_config.json, ...) removed, anything else left alone",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (evaluations still print)")
    parser.add_argument(
        "--plot", metavar="FILE",
        help="also draw the losses into FILE (.png, .pdf or .svg); with --preset book the book's "
        "figure 5.12: losses against epochs, tokens seen on a second axis",
    )
    parser.set_defaults(run=run)


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    given: dict[str, Any] = {k: getattr(args, k) for k in _OVERRIDES if getattr(args, k) is not None}
    if args.context_parallel:
        given["context_parallel"] = True
    if not args.resume:
        preset = given.pop("preset", DEFAULT_PRESET)
        return TrainSettings.from_preset(preset, data=args.data, out=args.out, **given)
    from qkv.training.loop import saved_settings  # torch: only once a run is really set up

    saved = saved_settings(args.out)
    if "max_steps" in given:
        given["epochs"] = None
    elif "epochs" in given:
        given["max_steps"] = None
    return saved.with_changes(data=args.data, out=args.out, **given)


def run(args: argparse.Namespace) -> int:
    if args.resume and args.overwrite:
        raise QkvError("--resume continues a run and --overwrite starts one over; give one of them")
    # Under torchrun the processes on this machine share its idle cores.
    apply_threads(args.threads, processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    from qkv.training.loop import train

    settings = settings_from_args(args)
    try:
        result = train(settings, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress)
    except QkvError:
        if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 reports
            return 2
        raise
    if args.plot and result.records and int(os.environ.get("RANK", "0")) == 0:
        _plot(settings, result, args.plot)
    return 0


def _plot(settings: TrainSettings, result: Any, path: str) -> None:
    if PRESETS[settings.preset].loop == "book":
        from qkv.training.book.figure import plot_book_losses

        epochs = settings.epochs if settings.max_steps is None else float(result.records[-1].get("epoch", 1))
        plot_book_losses(result.records, epochs, path)
    else:
        from qkv.training.metrics import plot_losses

        plot_losses(result.records, path, title=f"qkv train --preset {settings.preset}")
    print(f"losses drawn in {path}")
