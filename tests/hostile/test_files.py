"""Hostile model folders, GGUF files, chat templates, command lines and training folders.

Each case is built in a temporary folder from a valid tiny model (written by
qkv.save_pretrained or the gguf library's writer) with one thing changed, then run as a
real `qkv` command line by harness.py: all cases in one Python process that forks a child
per case under an address-space limit (1 GB above what torch itself maps) and a time limit.
Every case must give exit code 2, exactly one line on stderr that names the problem, no
traceback, finish in under 5 s, stay under 1 GB of extra memory, and open nothing under the
`outside` folder (sentinel files and FIFOs that block whoever opens them).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import qkv
from qkv.cli.main import main
from qkv.models.gguf.layout import permute_rows
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig

# One worker builds and runs every case (the module's fixture would run once per xdist worker).
pytestmark = pytest.mark.xdist_group("hostile-files")

HARNESS = Path(__file__).with_name("harness.py")
MAX_SECONDS = 5.0
MAX_EXTRA_MEMORY = 1 << 30
VOCAB = 300
TEXT = "Your journey starts with one step. Every effort moves you forward, " * 40


def tokenizer(vocab: int = VOCAB) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT, "naïve café 東京 1234567890 <>{}[]"], trainer)
    return tok


def gpt_folder(path: Path, vocab: int = VOCAB) -> Path:
    torch.manual_seed(0)
    model = GPT2Decoder(GPTConfig(vocab_size=vocab, context_length=32, emb_dim=32, n_heads=4, n_layers=2))
    qkv.save_pretrained(model.eval(), tokenizer(), path)
    return path


def llama_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )).eval()


def edit_json(path: Path, change: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    result = change(data)
    path.write_text(json.dumps(data if result is None else result))


def sharded(folder: Path, entry_for: Callable[[str], object]) -> None:
    """Replace model.safetensors by an index whose weight_map says entry_for(name)."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors").rename(folder / "shard.safetensors")
    index = {"metadata": {}, "weight_map": {n: entry_for(n) for n in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def write_gguf(path: Path, *, meta: dict | None = None, shapes: dict | None = None, drop: tuple = ()) -> Path:
    """A complete tiny llama GGUF (what llama.cpp's converter writes); `meta` overrides metadata
    values, `shapes` replaces tensors by zeros of another shape."""
    model = llama_model()
    tok = tokenizer()
    spec = json.loads(tok.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    values: dict[str, tuple[str, object]] = {
        "llama.block_count": ("uint32", 2), "llama.context_length": ("uint32", 64),
        "llama.embedding_length": ("uint32", 32), "llama.feed_forward_length": ("uint32", 48),
        "llama.attention.head_count": ("uint32", 4), "llama.attention.head_count_kv": ("uint32", 2),
        "llama.attention.layer_norm_rms_epsilon": ("float32", 1e-6), "llama.rope.freq_base": ("float32", 10000.0),
        "tokenizer.ggml.bos_token_id": ("uint32", 0), "tokenizer.ggml.eos_token_id": ("uint32", 1),
    }
    for key, value in (meta or {}).items():
        values[key] = value
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (kind, value) in values.items():
        if key in drop:
            continue
        if kind == "str":
            writer.add_string(key, value)
        elif kind == "int32":
            writer.add_int32(key, value)
        elif kind == "uint64":
            writer.add_uint64(key, value)
        else:
            getattr(writer, f"add_{kind}")(key, value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["merges"]])
    writer.add_token_types([1] * len(tokens))
    writer.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" or "rotary" in name:
            continue
        w = tensor.detach().float()
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            if module == "self_attn.q_proj":
                w = permute_rows(w, 4)
            elif module == "self_attn.k_proj":
                w = permute_rows(w, 2)
            gguf_name = f"blk.{i}.{layer[module]}.weight"
        else:
            gguf_name = names[name]
        array = np.zeros(shapes[gguf_name], dtype=np.float32) if shapes and gguf_name in shapes else w.numpy()
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ----------------------------------------------------------------------------- the cases
# Each builder gets (case folder, outside folder) and returns the argv; the fragment must
# appear in the one line of stderr.

GEN = ["--prompt", "Your journey", "--max-new-tokens", "2"]


def generate(folder: Path) -> list[str]:
    return ["generate", "--model", str(folder), *GEN]


def index_entry(entry: object) -> Callable[[Path, Path], list[str]]:
    def build(case: Path, outside: Path) -> list[str]:
        gpt_folder(case)
        sharded(case, lambda name: entry)
        return generate(case)

    return build


def index_escape_to_existing(case: Path, outside: Path) -> list[str]:
    gpt_folder(case)
    target = outside / "weights.safetensors"
    (case / "model.safetensors").replace(target)  # the folder's own weights, moved outside
    (case / "model.safetensors").symlink_to(target)
    sharded(case, lambda name: "../outside/weights.safetensors")
    (case / "shard.safetensors").unlink()
    return generate(case)


def index_escape_to_missing(case: Path, outside: Path) -> list[str]:
    gpt_folder(case)
    sharded(case, lambda name: "../outside/weights2.safetensors")
    (case / "shard.safetensors").unlink()
    return generate(case)


def index_to_fifo(case: Path, outside: Path) -> list[str]:
    gpt_folder(case)
    sharded(case, lambda name: "../outside/sentinel.fifo")
    return generate(case)


def index_absolute(case: Path, outside: Path) -> list[str]:
    gpt_folder(case)
    sharded(case, lambda name: str(outside / "sentinel.fifo"))
    return generate(case)


def shard_symlink_out(case: Path, outside: Path) -> list[str]:
    gpt_folder(case)
    sharded(case, lambda name: "link.safetensors")
    (case / "link.safetensors").symlink_to(outside / "sentinel.fifo")
    return generate(case)


def config_change(change: Callable[[dict], object], *, llama: bool = False) -> Callable[[Path, Path], list[str]]:
    def build(case: Path, outside: Path) -> list[str]:
        if llama:
            qkv.save_pretrained(llama_model(), tokenizer(), case)
        else:
            gpt_folder(case)
        edit_json(case / "config.json", change)
        return generate(case)

    return build


def index_text(text: str) -> Callable[[Path, Path], list[str]]:
    def build(case: Path, outside: Path) -> list[str]:
        gpt_folder(case)
        (case / "model.safetensors").unlink()
        (case / "model.safetensors.index.json").write_text(text)
        return generate(case)

    return build


def config_text(text: str) -> Callable[[Path, Path], list[str]]:
    def build(case: Path, outside: Path) -> list[str]:
        gpt_folder(case)
        (case / "config.json").write_text(text)
        return generate(case)

    return build


def weights(change: Callable[[dict], None], *, llama: bool = False) -> Callable[[Path, Path], list[str]]:
    def build(case: Path, outside: Path) -> list[str]:
        from safetensors.torch import load_file

        if llama:
            qkv.save_pretrained(llama_model(), tokenizer(), case)
        else:
            gpt_folder(case)
        tensors = load_file(str(case / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(case / "model.safetensors"))
        return generate(case)

    return build


def many_tensors(case: Path, outside: Path) -> list[str]:
    gpt_folder(case)
    save_file({f"junk.{i}": torch.zeros(1) for i in range(20_000)}, str(case / "model.safetensors"))
    return generate(case)


def big_tokenizer(case: Path, outside: Path) -> list[str]:
    gpt_folder(case, vocab=VOCAB)
    tok = tokenizer(VOCAB)
    tok.add_tokens([f"<extra{i}>" for i in range(50)])
    tok.save(str(case / "tokenizer.json"))
    return generate(case)


def tokenizer_folder(case: Path, outside: Path) -> list[str]:
    gpt_folder(case)
    (case / "tokenizer.json").unlink()
    (case / "tokenizer.json").mkdir()
    return generate(case)


def chat_config(value: object) -> Callable[[Path, Path], list[str]]:
    def build(case: Path, outside: Path) -> list[str]:
        gpt_folder(case)
        data = {**value, "eos_token": "a"} if isinstance(value, dict) else value  # a reply can end
        (case / "tokenizer_config.json").write_text(json.dumps(data))
        return ["generate", "--model", str(case), "--chat", *GEN]

    return build


def gguf_case(**changes: object) -> Callable[[Path, Path], list[str]]:
    def build(case: Path, outside: Path) -> list[str]:
        return generate(write_gguf(case / "m.gguf", **changes))

    return build


def train_into(prepare: Callable[[Path], None], *extra: str) -> Callable[[Path, Path], list[str]]:
    def build(case: Path, outside: Path) -> list[str]:
        data = case / "story.txt"
        data.write_text(TEXT * 3)
        out = case / "out"
        out.mkdir()
        prepare(out)
        return ["train", "--data", str(data), "--out", str(out), "--context-length", "8", "--batch-size", "2",
                "--max-steps", "2", "--no-progress", "--threads", "1", *extra]

    return build


def resume_with(change: Callable[[dict], None]) -> Callable[[Path, Path], list[str]]:
    """A real finished run (made once, copied) whose checkpoint metadata is then changed."""

    def build(case: Path, outside: Path) -> list[str]:
        import shutil

        from safetensors import safe_open
        from safetensors.torch import save

        out = case / "out"
        shutil.copytree(FINISHED_RUN, out)
        path = out / "checkpoint.safetensors"
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["qkv_training"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        change({"meta": meta, "tensors": tensors})
        path.write_bytes(save(tensors, metadata={"qkv_training": json.dumps(meta)}))
        return ["train", "--data", str(out.parent / "story.txt"), "--out", str(out), "--resume", "--no-progress",
                "--max-steps", "3"]

    return build


def cli(*argv: str) -> Callable[[Path, Path], list[str]]:
    return lambda case, outside: list(argv)


def _set(path: str, value: object) -> Callable[[dict], None]:
    def change(c: dict) -> None:
        *parents, last = path.split(".")
        target = c
        for p in parents:
            target = target[p]
        target[last] = value

    return change


def deep(n: int) -> str:
    return "[" * n + "]" * n


FINISHED_RUN: Path = Path()  # set by the fixture

CASES: dict[str, tuple[Callable[[Path, Path], list[str]], str]] = {
    # -- paths from metadata stay inside the folder
    "index-escape-existing": (index_escape_to_existing, "outside the model folder"),
    "index-escape-missing": (index_escape_to_missing, "outside the model folder"),
    "index-fifo": (index_to_fifo, "outside the model folder"),
    "index-absolute": (index_absolute, "outside the model folder"),
    "shard-symlink-out": (shard_symlink_out, "outside the model folder"),
    "index-number": (index_entry(5), "must be a file name inside"),
    "index-list": (index_entry(["a"]), "must be a file name inside"),
    "index-folder-itself": (index_entry("."), "outside the model folder"),
    "index-deep": (index_text('{"weight_map": ' + deep(100_000) + "}"), "nested too deeply"),
    # -- configs: sizes, types, values
    "gpt2-layers-1e9": (config_change(_set("n_layer", 10**9)), "n_layer must be between 1 and 1,024"),
    "llama-layers-1e9": (config_change(_set("num_hidden_layers", 10**9), llama=True), "num_hidden_layers must be between"),
    "gpt2-vocab-1e12": (config_change(_set("vocab_size", 10**12)), "vocab_size must be between"),
    "gpt2-positions-1e12": (config_change(_set("n_positions", 10**12)), "n_positions must be between"),
    "gpt2-big-config-small-file": (config_change(lambda c: c.update(n_embd=8192, n_head=8, n_layer=1000)),
                                   "missing weight(s) transformer.h.2.ln_1.weight"),
    "architectures-5": (config_change(_set("architectures", 5)), "architectures must be a list"),
    "model-type-list": (config_change(_set("model_type", ["gpt2"])), "unknown architecture"),
    "rope-yarn-string": (config_change(_set("rope_scaling", "yarn"), llama=True), "rope_scaling must be an object"),
    "rope-list": (config_change(_set("rope_scaling", [1, 2]), llama=True), "rope_scaling must be an object"),
    "rope-yarn": (config_change(_set("rope_scaling", {"rope_type": "yarn", "factor": 2.0}), llama=True), "'yarn' is not supported"),
    "rope-factor-nan": (config_change(_set("rope_scaling", {"rope_type": "llama3", "factor": math.nan, "low_freq_factor": 1,
                                                             "high_freq_factor": 4, "original_max_position_embeddings": 8}),
                                      llama=True), "factor must be finite"),
    "eps-string": (config_change(_set("layer_norm_epsilon", "abc")), "layer_norm_epsilon must be a number"),
    "eps-nan": (config_change(_set("layer_norm_epsilon", math.nan)), "layer_norm_epsilon must be finite"),
    "eps-inf": (config_change(_set("layer_norm_epsilon", math.inf)), "layer_norm_epsilon must be finite"),
    "eps-negative": (config_change(_set("layer_norm_epsilon", -1e-5)), "layer_norm_epsilon must be positive"),
    "rms-eps-nan": (config_change(_set("rms_norm_eps", math.nan), llama=True), "rms_norm_eps must be finite"),
    "heads-string": (config_change(_set("num_attention_heads", "four"), llama=True), "num_attention_heads must be an integer"),
    "heads-zero": (config_change(_set("n_head", 0)), "n_head must be between"),
    "heads-indivisible": (config_change(_set("n_head", 3)), "divisible by n_heads"),
    "kv-heads-more": (config_change(_set("num_key_value_heads", 8), llama=True), "num_key_value_heads must be between"),
    "bool-as-int": (config_change(_set("n_layer", True)), "n_layer must be an integer"),
    "tie-string": (config_change(_set("tie_word_embeddings", "yes"), llama=True), "tie_word_embeddings must be true or false"),
    "config-list": (config_text("[1, 2]"), "must hold a JSON object"),
    "config-deep": (config_text(deep(100_000)), "nested too deeply"),
    "config-binary": (config_text("\x00\x01"), "cannot read"),
    # -- weights
    "weights-nan": (weights(lambda t: t["transformer.wte.weight"].fill_(math.nan)), "NaN or infinite"),
    "weights-int64": (weights(lambda t: t.update({"transformer.wte.weight": t["transformer.wte.weight"].long()})),
                      "stored as I64"),
    "weights-bool": (weights(lambda t: t.update({"transformer.ln_f.bias": t["transformer.ln_f.bias"].bool()})),
                     "stored as BOOL"),
    "weights-shape": (weights(lambda t: t.update({"model.norm.weight": torch.ones(31)}), llama=True),
                      "has shape (31,), expected (32,)"),
    "weights-20000": (many_tensors, "missing weight(s)"),
    # -- tokenizer and chat template
    "tokenizer-larger": (big_tokenizer, "tokens but the model's vocabulary has 300"),
    "tokenizer-folder": (tokenizer_folder, "tokenizer.json"),
    "tokenizer-config-list": (chat_config([1, 2]), "must hold a JSON object"),
    "chat-template-list": (chat_config({"chat_template": [1, 2]}), "chat_template must be a string or a list"),
    "chat-template-number": (chat_config({"chat_template": 5}), "chat_template must be a string"),
    "chat-nested-range": (chat_config({"chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}"
                                                        "{% endfor %}{% endfor %}"}), "loop iterations and calls"),
    "chat-range-float": (chat_config({"chat_template": "{{ range(1e8) }}"}), "chat template failed"),
    "chat-recursion": (chat_config({"chat_template": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"}), "nests calls"),
    "chat-repeat": (chat_config({"chat_template": "{{ 'x' * 100000000000 }}"}), "repeats a value"),
    "chat-repeat-float": (chat_config({"chat_template": "{{ 'x' * 1e11 }}"}), "chat template failed"),
    "chat-doubling": (chat_config({"chat_template": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                                                    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}"}), "made a value"),
    "chat-center": (chat_config({"chat_template": "{{ 'x'|center(10000000000) }}"}), "passed the number"),
    # -- GGUF metadata and tensors
    "gguf-layers-1e9": (gguf_case(meta={"llama.block_count": ("uint32", 10**9)}), "block_count must be between"),
    "gguf-key-length-1e6": (gguf_case(meta={"llama.attention.key_length": ("uint32", 10**6)}),
                            "q_proj.weight has shape (32, 32), expected (4000000, 32)"),
    "gguf-heads-zero": (gguf_case(meta={"llama.attention.head_count": ("uint32", 0)}), "head_count must be between"),
    "gguf-heads-string": (gguf_case(meta={"llama.attention.head_count": ("str", "four")}), "head_count must be an integer"),
    "gguf-heads-3": (gguf_case(meta={"llama.attention.head_count": ("uint32", 3)}), "not divisible by head_count 3"),
    "gguf-heads-1e9": (gguf_case(meta={"llama.attention.head_count": ("uint32", 10**9)}), "head_count must be between"),
    "gguf-kv-heads-more": (gguf_case(meta={"llama.attention.head_count_kv": ("uint32", 8)}), "head_count_kv must be between"),
    "gguf-eps-nan": (gguf_case(meta={"llama.attention.layer_norm_rms_epsilon": ("float32", math.nan)}), "must be finite"),
    "gguf-bos-out-of-range": (gguf_case(meta={"tokenizer.ggml.bos_token_id": ("uint32", 10**6)}), "bos_token_id is 1000000"),
    "gguf-vocab-1e12": (gguf_case(meta={"llama.vocab_size": ("uint64", 10**12)}), "vocab_size must be between"),
    "gguf-tensor-shape": (gguf_case(shapes={"blk.0.attn_q.weight": (32, 16)}), "has shape (32, 16), expected (32, 32)"),
    "gguf-missing-tensor": (gguf_case(shapes=None, meta={"llama.block_count": ("uint32", 3)}), "missing weight(s)"),
    # -- numbers on the command line
    "temperature-tiny": (cli("generate", "--model", "nowhere", "--prompt", "x", "--temperature", "1e-300"), "argument --temperature"),
    "temperature-inf": (cli("generate", "--model", "nowhere", "--prompt", "x", "--temperature", "inf"), "argument --temperature"),
    "temperature-nan": (cli("chat", "--temperature", "nan"), "argument --temperature"),
    "top-p-zero": (cli("generate", "--prompt", "x", "--top-p", "0"), "argument --top-p"),
    "seed-1e23": (cli("generate", "--prompt", "x", "--seed", "1e23"), "argument --seed"),
    "seed-huge": (cli("generate", "--prompt", "x", "--seed", str(10**23)), "argument --seed"),
    "explain-seed-1e23": (cli("explain", "--seed", "1e23"), "argument --seed"),
    "explain-seed-huge": (cli("explain", "--seed", str(10**23)), "argument --seed"),
    "explain-d-out-1e9": (cli("explain", "--d-out", "1e9"), "argument --d-out"),
    "explain-d-out-100000": (cli("explain", "--d-out", "100000"), "argument --d-out"),
    "explain-layer-negative": (cli("explain", "--layer", "-1"), "--layer -1 is out of range"),
    "explain-layer-book": (cli("explain", "--layer", "3"), "--layer 3 is out of range"),
    "max-new-tokens-negative": (cli("generate", "--prompt", "x", "--max-new-tokens", "-1"), "argument --max-new-tokens"),
    "max-memory-text": (cli("generate", "--prompt", "x", "--max-memory", "lots"), "argument --max-memory"),
    "perplexity-context-huge": (cli("perplexity", "--data", "x", "--context-length", "1e12"), "argument --context-length"),
    "train-lr-nan": (cli("train", "--data", "x", "--out", "y", "--lr", "nan"), "argument --lr"),
    "train-batch-huge": (cli("train", "--data", "x", "--out", "y", "--batch-size", str(10**12)), "argument --batch-size"),
    "max-memory-small": (lambda case, outside: [*generate(gpt_folder(case)), "--max-memory", "10KB"], "more than --max-memory"),
    # -- training output folders
    "train-out-not-qkv": (train_into(lambda out: (out / "notes.txt").write_text("mine")), "holds no qkv training run"),
    "train-out-metrics-5": (train_into(lambda out: (out / "metrics.jsonl").write_text("5\n")), "holds no qkv training run"),
    "train-out-metrics-binary": (train_into(lambda out: (out / "metrics.jsonl").write_bytes(b"\xff\xfe\x00\n")),
                                 "holds no qkv training run"),
    "train-out-tokenizer-folder": (train_into(lambda out: (out / "tokenizer.json").mkdir()), "holds no qkv training run"),
    "train-overwrite-tokenizer-folder": (train_into(lambda out: (out / "tokenizer.json").mkdir(), "--overwrite"),
                                         "is a folder where qkv writes a file"),
    "train-resume-nothing": (train_into(lambda out: None, "--resume"), "no training checkpoint"),
    "train-resume-and-overwrite": (train_into(lambda out: None, "--resume", "--overwrite"), "give one of them"),
    "resume-step-string": (resume_with(lambda c: c["meta"]["state"].update(step="ten")), "state.step"),
    "resume-step-negative": (resume_with(lambda c: c["meta"]["state"].update(step=-3)), "state.step"),
    "resume-settings-types": (resume_with(lambda c: c["meta"]["state"]["settings"].update(lr="fast")), "setting lr"),
    "resume-settings-list": (resume_with(lambda c: c["meta"]["state"].update(settings=[1])), "must be objects"),
    "resume-optimizer-lr": (resume_with(lambda c: c["meta"]["optimizer"]["param_groups"][0].update(lr="x")), "optimizer lr"),
    "resume-optimizer-groups": (resume_with(lambda c: c["meta"]["optimizer"].update(param_groups=5)), "param_groups"),
    "resume-scheduler": (resume_with(lambda c: c["meta"].update(scheduler=[1])), "scheduler must be an object"),
    "resume-scheduler-lrs": (resume_with(lambda c: c["meta"]["scheduler"].update(base_lrs=["a"])), "base_lrs"),
    "resume-rng-type": (resume_with(lambda c: c["tensors"].update({"rng.cpu.0": torch.zeros(3)})), "RNG state"),
    "resume-world-size": (resume_with(lambda c: c["meta"]["state"].update(world_size=10**9)), "world_size"),
}


# One worker runs every case: the module fixture (a training run and the harness) runs once.
pytestmark = pytest.mark.xdist_group("hostile_files")


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict:
    global FINISHED_RUN
    root = tmp_path_factory.mktemp("hostile")
    outside = root / "outside"
    outside.mkdir()
    os.mkfifo(outside / "sentinel.fifo")
    (outside / "sentinel.txt").write_text("secret")
    FINISHED_RUN = root / "finished" / "out"
    FINISHED_RUN.parent.mkdir()
    (FINISHED_RUN.parent / "story.txt").write_text(TEXT * 3)
    # The run the resume cases start from: trained in this process (its start-up is not what
    # these cases check; the harness runs each case as a command line of its own).
    threads = torch.get_num_threads()
    try:
        assert main(["train", "--data", str(FINISHED_RUN.parent / "story.txt"), "--out", str(FINISHED_RUN),
                     "--context-length", "8", "--batch-size", "2", "--max-steps", "2", "--no-progress",
                     "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)  # --threads 1 set this worker's
    cases, before = [], {}
    for name, (build, _) in CASES.items():
        case = root / name
        case.mkdir()
        argv = build(case, outside)
        before[name] = snapshot(case)
        cases.append({"id": name, "argv": argv, "cwd": str(case)})
    (root / "cases.json").write_text(json.dumps(cases))
    work = root / "work"
    work.mkdir()
    run = subprocess.run(
        [sys.executable, str(HARNESS), str(root / "cases.json"), str(root / "results.json"), str(outside), str(work)],
        capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((root / "results.json").read_text())
    after = {name: snapshot(root / name) for name in CASES}
    return {"parent_rss": results["parent_rss"], "results": {r["id"]: r for r in results["results"]},
            "before": before, "after": after, "outside": sorted(p.name for p in outside.iterdir())}


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (not following links) with a hash of its bytes."""
    state = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            state[str(path.relative_to(folder))] = "-> " + os.readlink(path)
        elif path.is_file():
            state[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_dir():
            state[str(path.relative_to(folder)) + "/"] = "dir"
    return state


@pytest.mark.parametrize("name", list(CASES))
def test_one_line_exit_2_bounded_contained_nothing_lost(outcome: dict, name: str) -> None:
    r = outcome["results"][name]
    fragment = CASES[name][1]
    lines = r["stderr"].strip().splitlines()
    assert not r["timed_out"], f"{name} ran out of time (did it open a sentinel FIFO?): {r['stderr'][-500:]}"
    assert r["code"] == 2, f"{name}: exit {r['code']}: {r['stderr'][-1500:]}"
    assert "Traceback" not in r["stderr"] and len(lines) == 1, r["stderr"][-1500:]
    assert fragment in lines[0], lines[0]
    assert r["stdout"] == ""
    assert r["seconds"] < MAX_SECONDS, f"{name} took {r['seconds']:.1f} s"
    assert r["max_rss"] - outcome["parent_rss"] < MAX_EXTRA_MEMORY, f"{name} grew by {r['max_rss'] - outcome['parent_rss']:,} bytes"
    assert r["opened"] == [], f"{name} opened {r['opened']}"
    before, after = outcome["before"][name], outcome["after"][name]
    lost = {k: v for k, v in before.items() if after.get(k) != v and k != "out/.qkv-run.lock"}
    assert not lost, f"{name} changed or removed {sorted(lost)}"


def test_an_escaping_entry_reads_the_same_whether_or_not_its_target_exists(outcome: dict) -> None:
    results = outcome["results"]
    existing = results["index-escape-existing"]["stderr"].replace("index-escape-existing", "CASE")
    missing = results["index-escape-missing"]["stderr"].replace("index-escape-missing", "CASE")
    missing = missing.replace("weights2.safetensors", "weights.safetensors")
    assert existing == missing


def test_nothing_outside_was_touched(outcome: dict) -> None:
    assert outcome["outside"] == ["sentinel.fifo", "sentinel.txt", "weights.safetensors"]
