"""Issue 28's failures re-created: tokenizer and chat-template bombs, damaged caches, terminal
escapes and a full disk, each run as a real `qkv` command line by harness.py.

Unlike test_files.py, each child may map 5 GB more than torch (QKV_HOSTILE_LIMIT_BYTES), so
that a bomb that allocates before it is refused is seen (its peak resident memory passes the
512 MB budget) instead of failing tidily with MemoryError. Refusals must be one line, exit 2,
within 5 s; cache cases must repair themselves with one line and print what a run without
any cache prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Regex, decoders, normalizers, pre_tokenizers

sys.path.insert(0, str(Path(__file__).parent))
from test_files import GEN, HARNESS, TEXT, gpt_folder, snapshot, tokenizer, write_gguf  # noqa: E402

pytestmark = pytest.mark.xdist_group("hostile-strangers")

MAX_SECONDS = 5.0
MEMORY_BUDGET = 512 << 20
HEADROOM = 5 << 30  # what a child may map: more than any bomb here needs
ESCAPE = "\x1b]0;pwned\x07\x1b[2J"
INT8 = ["--dtype", "int8", "--no-compile", "--prompt", "Your journey", "--max-new-tokens", "4", "--threads", "1"]


@dataclass(frozen=True)
class Expect:
    code: int = 2
    fragment: str = ""  # in the one line of stderr (code 2) or in one of its lines (code 0)
    lines: int | None = 1  # lines on stderr; None: any
    same_stdout_as: str | None = None  # a reference case whose stdout this one must print
    unchanged: bool = False  # the case folder must be exactly as before (no new files)


# ----------------------------------------------------------------------------- builders


def with_tokenizer(change: Callable[[object], None], argv: Callable[[Path], list[str]] | None = None):
    def build(case: Path, state: dict) -> list[str]:
        gpt_folder(case)
        tok = tokenizer()
        change(tok)
        tok.save(str(case / "tokenizer.json"))
        return argv(case) if argv else ["generate", "--model", str(case), *GEN]

    return build


def replace_chain(steps: int, times: int) -> Callable[[object], None]:
    def change(tok) -> None:
        tok.normalizer = normalizers.Sequence([normalizers.Replace("o", "o" * times) for _ in range(steps)])

    return change


SPLIT_REFUSED = "the regex '(a|aa)+$'"  # split_regex's, in either refusal's line


def split_regex(tok) -> None:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("(a|aa)+$"), "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)])


def decoder_chain(tok) -> None:
    tok.decoder = decoders.Sequence([decoders.ByteLevel()] + [decoders.Replace("o", "o" * 40) for _ in range(5)])


def escaping_decoder(tok) -> None:
    tok.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace(Regex("."), ESCAPE)])


def train_with(change: Callable[[object], None]):
    def build(case: Path, state: dict) -> list[str]:
        data = case / "story.txt"
        data.write_text(TEXT * 3)
        tok = tokenizer()
        change(tok)
        tok.save(str(case / "given.json"))
        (case / "out").mkdir()
        return ["train", "--data", str(data), "--out", str(case / "out"), "--tokenizer", str(case / "given.json"),
                "--context-length", "8", "--batch-size", "2", "--max-steps", "2", "--no-progress", "--threads", "1"]

    return build


def template(source: str):
    def build(case: Path, state: dict) -> list[str]:
        gpt_folder(case)
        (case / "tokenizer_config.json").write_text(json.dumps({"chat_template": source, "eos_token": "a"}))
        return ["generate", "--model", str(case), "--chat", *GEN]

    return build


def gguf_template(source: str):
    def build(case: Path, state: dict) -> list[str]:
        import gguf

        original = gguf.GGUFWriter.add_chat_template
        gguf.GGUFWriter.add_chat_template = lambda self, _: original(self, source)
        try:
            path = write_gguf(case / "m.gguf")
        finally:
            gguf.GGUFWriter.add_chat_template = original
        return ["generate", "--model", str(path), "--chat", *GEN]

    return build


SORTS = "{% set l = ((range(100000)|list)*10)|reverse|list %}{% set x = [" + ", ".join(["l|sort"] * 40) + "] %}done"


# ----------------------------------------------------------------------------- caches


def _gguf_pair(case: Path) -> tuple[Path, bytes, bytes]:
    """A tiny llama GGUF, and the same file with its final norm negated (same size; the tied
    head then ranks every token the other way round)."""
    import gguf

    path = write_gguf(case / "m.gguf")
    original = path.read_bytes()
    reader = gguf.GGUFReader(str(path))
    embedding = next(t for t in reader.tensors if t.name == "output_norm.weight")
    start = int(embedding.data_offset)
    end = start + int(embedding.n_bytes)
    import numpy as np

    negated = (-np.frombuffer(original[start:end], dtype=np.float32)).tobytes()
    swapped = original[:start] + negated + original[end:]
    assert len(swapped) == len(original) and swapped != original
    del reader
    return path, original, swapped


def cached(case: Path, state: dict, *, swap: bool = False) -> list[str]:
    """A GGUF whose int8 entry the first pass writes (in the case's own cache folder)."""
    path, original, swapped = _gguf_pair(case)
    state["swapped"] = swapped
    return ["generate", "--model", str(path), *INT8]


def reference(which: str):
    def build(case: Path, state: dict) -> list[str]:
        path, original, swapped = _gguf_pair(case)
        path.write_bytes(swapped if which == "swapped" else original)
        return ["generate", "--model", str(path), *INT8]

    return build


# tampering done between the two passes: (case folder, its prepared entry) -> None


def _rewrite_entry(entry: Path, change: Callable[[dict], None], *, recompute: bool) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from qkv.util.cache_integrity import tensors_digest
    from qkv.runtime.prepared_cache import DIGEST_KEY

    with safe_open(str(entry), "pt") as handle:
        metadata = handle.metadata() or {}
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    change(tensors)
    if recompute:
        metadata = {DIGEST_KEY: tensors_digest(tensors)}
    save_file(tensors, str(entry), metadata=metadata)


def _first_float(tensors: dict) -> str:
    return next(n for n, t in sorted(tensors.items()) if t.is_floating_point() and t.numel() > 1)


def swap_same_size_same_mtime(case: Path, entry: Path, state: dict) -> None:
    path = case / "m.gguf"
    before = path.stat()
    path.write_bytes(state["swapped"])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns


def other_dtype(case: Path, entry: Path, state: dict) -> None:
    _rewrite_entry(entry, lambda t: t.update({_first_float(t): t[_first_float(t)].half()}), recompute=True)


def nan_values(case: Path, entry: Path, state: dict) -> None:
    _rewrite_entry(entry, lambda t: t[_first_float(t)].view(-1).__setitem__(0, float("nan")), recompute=True)


def negated_unsigned(case: Path, entry: Path, state: dict) -> None:
    _rewrite_entry(entry, lambda t: t.update({_first_float(t): -t[_first_float(t)]}), recompute=False)


def truncated(case: Path, entry: Path, state: dict) -> None:
    data = entry.read_bytes()
    entry.write_bytes(data[: len(data) // 2])


def killed_writers(case: Path, entry: Path, state: dict) -> None:
    for folder in (entry.parent, case / "cache" / "native"):
        (folder / f".{entry.name}.999999999.deadbeef.tmp").write_bytes(b"x" * 4096)  # a pid that cannot exist
        (folder / f".{entry.name}.{os.getpid()}.0badf00d.tmp").write_bytes(b"y")  # a live writer: kept
        old = folder / "tmpab12cd34.tmp"  # what mkstemp left before: removed by age
        old.write_bytes(b"z")
        os.utime(old, (time.time() - 7200, time.time() - 7200))


def foreign_library(case: Path, entry: Path, state: dict) -> None:
    from qkv.util.cache_integrity import file_sha256

    library = next((case / "cache" / "native").glob("*.so"))
    source = case / "empty.cpp"
    source.write_text("extern \"C\" int qkv_nothing() { return 0; }\n")
    compiler = shutil.which("c++") or shutil.which("g++")
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(library)], check=True, timeout=120)
    Path(str(library) + ".sha256").write_text(file_sha256(library) + "\n")


CACHE_ENV = {"QKV_PREPARED_MIN_BYTES": "0", "QKV_PREPARED_CACHE": None}
TAMPER: dict[str, tuple[Callable[[Path, Path, dict], None], Expect]] = {
    "cache-same-size-same-mtime-swap": (swap_same_size_same_mtime, Expect(0, "tokens in", 1, "ref-swapped")),
    "cache-other-dtype": (other_dtype, Expect(0, "the model needs", 2, "ref-original")),
    "cache-nan": (nan_values, Expect(0, "NaN, infinite", 2, "ref-original")),
    "cache-negated-unsigned": (negated_unsigned, Expect(0, "checksum does not match", 2, "ref-original")),
    "cache-truncated": (truncated, Expect(0, "discarded", 2, "ref-original")),
    "cache-killed-writers": (killed_writers, Expect(0, "tokens in", 1, "ref-original")),
    "cache-foreign-library": (foreign_library, Expect(0, "discarded", None)),
}

# ----------------------------------------------------------------------------- the cases

CASES: dict[str, tuple[Callable[[Path, dict], list[str]], Expect]] = {
    # -- tokenizers
    "tokenizer-replace-5-steps": (with_tokenizer(replace_chain(5, 40)), Expect(fragment="can grow text 102,400,000 times")),
    "tokenizer-replace-1-step": (with_tokenizer(replace_chain(1, 1000), lambda c: [
        "generate", "--model", str(c), "--prompt", "o" * 4000, "--max-new-tokens", "1"]), Expect(fragment="would grow this")),
    # refused either by the probe's timing ("backtracks exponentially") or, when a loaded machine
    # lets the ladder run longer, by the library's panic ("catastrophic backtracking"): both name it
    "tokenizer-split-panic": (with_tokenizer(split_regex), Expect(fragment=SPLIT_REFUSED)),
    "tokenizer-decoder-5-steps": (with_tokenizer(decoder_chain), Expect(fragment="its decoder can grow text")),
    "train-tokenizer-replace-4-steps": (train_with(replace_chain(4, 40)), Expect(fragment="can grow text", unchanged=True)),
    "train-tokenizer-split-panic": (train_with(split_regex), Expect(fragment=SPLIT_REFUSED, unchanged=True)),
    # -- chat templates (GGUF templates take the same path)
    "template-join": (template("{{ ([('x'*1000000)]*2500)|join }}"), Expect(fragment="chat template went over")),
    "template-expandtabs": (template("{{ ('\\t'*1000).expandtabs(1000000) }}"), Expect(fragment="chat template went over")),
    "template-replace": (template("{{ ('x'*100000).replace('x', 'y'*50000) }}"), Expect(fragment="chat template went over")),
    "template-format-width": (template("{% set ns = namespace(l=[]) %}{% for i in range(5000) %}"
                                       "{% set ns.l = ns.l + ['{0:1000000}'.format(i)] %}{% endfor %}{{ ns.l|length }}"),
                              Expect(fragment="chat template went over")),
    "template-tojson-indent": (template("{{ (range(1000)|list)|tojson(indent=1000000) }}"), Expect(fragment="indent must be")),
    "template-40-sorts": (template(SORTS), Expect(fragment="chat template went over a limit")),
    "gguf-template-join": (gguf_template("{{ ([('x'*1000000)]*2500)|join }}"), Expect(fragment="chat template went over")),
    # -- caches
    "ref-original": (reference("original"), Expect(0, "tokens in", 1)),
    "ref-swapped": (reference("swapped"), Expect(0, "tokens in", 1)),
    **{name: (cached, expect) for name, (_, expect) in TAMPER.items()},
    "cache-relative-xdg": (lambda case, state: ["generate", "--model", str(write_gguf(case / "m.gguf")), *INT8],
                           Expect(fragment="XDG_CACHE_HOME is the relative path")),
    # -- model text on the terminal
    "escapes-generate": (with_tokenizer(escaping_decoder), Expect(0, "tokens in", None)),
    "escapes-explain": (with_tokenizer(escaping_decoder, lambda c: ["explain", "--model", str(c), "Your journey"]),
                        Expect(0, "", None)),
}
ENV = {
    "ref-original": {"QKV_PREPARED_CACHE": "0"}, "ref-swapped": {"QKV_PREPARED_CACHE": "0"},
    "cache-relative-xdg": {"QKV_CACHE_DIR": None, "XDG_CACHE_HOME": "relative-cache"},
}


def _run_harness(root: Path, cases: list[dict], tag: str) -> dict:
    (root / f"{tag}.json").write_text(json.dumps(cases))
    work = root / f"work-{tag}"
    work.mkdir()
    outside = root / "outside"
    outside.mkdir(exist_ok=True)
    env = {**os.environ, "QKV_HOSTILE_LIMIT_BYTES": str(HEADROOM)}
    run = subprocess.run([sys.executable, str(HARNESS), str(root / f"{tag}.json"), str(root / f"{tag}-results.json"),
                          str(outside), str(work)], capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((root / f"{tag}-results.json").read_text())


def _library() -> Path | None:
    from qkv.runtime.native import native_kernels

    status = native_kernels()
    return status.path if status.available else None


@contextlib.contextmanager
def _small_disk(folder: Path):
    """A 1 MB tmpfs at `folder` where we may mount one (root), else None (RLIMIT_FSIZE then)."""
    folder.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], capture_output=True)


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("strangers")
    library = _library()
    cases, before, states = [], {}, {}
    for name, (build, _) in CASES.items():
        case = root / name
        case.mkdir()
        states[name] = {}
        argv = build(case, states[name])
        env = {"QKV_CACHE_DIR": str(case / "cache"), **CACHE_ENV, **ENV.get(name, {})}
        if library is not None and name != "cache-relative-xdg":  # a copy of this machine's kernels: nothing to build
            (case / "cache" / "native").mkdir(parents=True)
            for file in (library, Path(str(library) + ".sha256")):
                shutil.copy2(file, case / "cache" / "native" / file.name)
        before[name] = snapshot(case)
        cases.append({"id": name, "argv": argv, "cwd": str(case), "env": env})
    (root / "full").mkdir()
    with _small_disk(root / "full" / "out") as mounted:
        data = root / "full" / "story.txt"
        data.write_text(TEXT * 3)
        disk = {"id": "train-disk-full", "cwd": str(root / "full"), "env": {}, "argv": [
            "train", "--data", str(data), "--out", str(root / "full" / "out"), "--context-length", "8",
            "--batch-size", "2", "--max-steps", "2", "--no-progress", "--threads", "1"]}
        if not mounted:
            disk["file_size_limit"] = 200_000
        first = _run_harness(root, [*cases, disk], "first")
        after_disk = sorted(p.name for p in (root / "full" / "out").iterdir())
    results = {r["id"]: r for r in first["results"]}
    if library is not None:  # the second pass: the cache entries of the first, tampered with
        second = []
        for name, (tamper, _) in TAMPER.items():
            entries = list((root / name / "cache" / "prepared").glob("*.safetensors"))
            assert len(entries) == 1, f"{name}: the first run kept {entries}: {results[name]['stderr']}"
            tamper(root / name, entries[0], states[name])
            second.append(next(c for c in cases if c["id"] == name))
        for r in _run_harness(root, second, "second")["results"]:
            results[r["id"]] = r
    return {"parent_rss": first["parent_rss"], "results": results, "root": root, "before": before,
            "library": library, "disk": (mounted, after_disk)}


def _check(outcome: dict, name: str, expect: Expect) -> dict:
    r = outcome["results"][name]
    lines = r["stderr"].strip().splitlines()
    assert not r["timed_out"], f"{name} ran out of time: {r['stderr'][-500:]}"
    assert r["code"] == expect.code, f"{name}: exit {r['code']}: {r['stderr'][-1500:]}"
    assert "Traceback" not in r["stderr"], r["stderr"][-1500:]
    if expect.lines is not None:
        assert len(lines) == expect.lines, f"{name}: {r['stderr'][-1500:]}"
    assert any(expect.fragment in line for line in lines) or not expect.fragment, lines
    assert r["seconds"] < MAX_SECONDS or expect.code == 0, f"{name} took {r['seconds']:.1f} s"
    growth = r["max_rss"] - outcome["parent_rss"]
    assert growth < MEMORY_BUDGET, f"{name} grew by {growth:,} bytes"
    if expect.same_stdout_as is not None:
        assert r["stdout"] == outcome["results"][expect.same_stdout_as]["stdout"] != "", (r["stdout"], expect)
    if expect.unchanged:
        assert snapshot(outcome["root"] / name) == outcome["before"][name]
    if expect.code == 2:
        assert r["stdout"] == ""
    return r


@pytest.mark.parametrize("name", [n for n in CASES if n not in TAMPER])
def test_refused_in_one_line_or_run_as_without_it(outcome: dict, name: str) -> None:
    _check(outcome, name, CASES[name][1])


@pytest.mark.parametrize("name", list(TAMPER))
def test_a_damaged_cache_is_repaired_with_one_line(outcome: dict, name: str) -> None:
    if outcome["library"] is None:
        pytest.skip("qkv's kernels are not available here, so nothing is prepared at int8 or kept")
    r = _check(outcome, name, TAMPER[name][1])
    entries = list((outcome["root"] / name / "cache" / "prepared").glob("*.safetensors"))
    # rebuilt in place; the swapped file gets an entry of its own; without qkv's kernels none
    expected = {"cache-same-size-same-mtime-swap": 2, "cache-foreign-library": 1}.get(name, 1)
    assert len(entries) == expected, (entries, r["stderr"])


def test_a_swapped_file_prints_its_own_text_not_the_old_one(outcome: dict) -> None:
    results = outcome["results"]
    assert results["ref-original"]["stdout"] != results["ref-swapped"]["stdout"]  # the swap changes the text


def test_only_the_temporaries_of_dead_writers_are_removed(outcome: dict) -> None:
    if outcome["library"] is None:
        pytest.skip("qkv's kernels are not available here")
    case = outcome["root"] / "cache-killed-writers" / "cache"
    for folder in (case / "prepared", case / "native"):
        names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))
        assert len(names) == 1 and f".{os.getpid()}." in names[0], names


def test_a_foreign_library_is_discarded_before_the_next_run(outcome: dict) -> None:
    if outcome["library"] is None:
        pytest.skip("qkv's kernels are not available here")
    assert list((outcome["root"] / "cache-foreign-library" / "cache" / "native").glob("*.so")) == []


def test_a_relative_cache_folder_puts_nothing_in_the_current_folder(outcome: dict) -> None:
    assert not (outcome["root"] / "cache-relative-xdg" / "relative-cache").exists()


@pytest.mark.parametrize("name", ["escapes-generate", "escapes-explain"])
def test_model_text_reaches_the_terminal_escaped(outcome: dict, name: str) -> None:
    out = outcome["results"][name]["stdout"]
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b]0;pwned\\x07\\x1b[2J" in out


def test_a_full_disk_during_training_is_one_line_and_leaves_no_partial_file(outcome: dict) -> None:
    r = outcome["results"]["train-disk-full"]
    lines = r["stderr"].strip().splitlines()
    assert r["code"] == 2 and len(lines) == 1 and "is full" in lines[0], r["stderr"][-1500:]
    mounted, names = outcome["disk"]
    assert not [n for n in names if n.endswith(".tmp")], names


def test_qkv_chat_writes_model_text_escaped(tmp_path: Path) -> None:
    """`qkv chat` (stdin, not the harness's argv) prints replies through the same escaping."""
    with_tokenizer(escaping_decoder)(tmp_path, {})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}", "eos_token": "a"}))
    code = "import sys; from qkv.cli.main import main; raise SystemExit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, "chat", "--model", str(tmp_path), "--max-new-tokens", "3",
                           "--temperature", "0", "--no-compile"], input="Your journey\n/exit\n",
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-1500:]
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "\\x1b]0;pwned\\x07\\x1b[2J" in done.stdout
