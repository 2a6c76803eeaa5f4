"""Old import paths, kept for one release: `import qkv.perf.quantize` still works, warns, and
gives the objects of the module's new home (the house was laid out anew in 0.2; the map below
is the whole list).

An old path is answered by a small module of its own that holds the new module's public names
(and the few names that were renamed), so the new module itself is never altered. Old packages
(`qkv.perf`, `qkv.native`) get an empty `__path__`, so their old submodules resolve here too.
Five old modules gave their name to the package that now holds them (`qkv.chat`,
`qkv.models.gguf`, `qkv.serve.engine`, `qkv.serve.explorer`, `qkv.cli.explain`): those paths
import the package, and `qkv.chat` and `qkv.models.gguf` forward their old public names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# old module -> the module(s) its names now live in
MOVED: dict[str, tuple[str, ...]] = {
    "qkv.atomic": ("qkv.util.atomic",),
    "qkv.attention.kv_cache": ("qkv.attention.caches.kv_cache",),
    "qkv.attention.quantize": ("qkv.attention.caches.quantize",),
    "qkv.attention.quantized_cache": ("qkv.attention.caches.quantized_cache",),
    "qkv.attention.sink_cache": ("qkv.attention.caches.sink_cache",),
    "qkv.attention.window_cache": ("qkv.attention.caches.window_cache",),
    "qkv.attention_steps": ("qkv.book.steps",),
    "qkv.bench.attention": ("qkv.bench.sections.attention",),
    "qkv.bench.cache": ("qkv.bench.sections.cache",),
    "qkv.bench.decode": ("qkv.bench.sections.decode",),
    "qkv.bench.gpt2": ("qkv.bench.gpt2_checkpoint",),
    "qkv.bench.kv_cache": ("qkv.bench.sections.kv_cache",),
    "qkv.bench.plot": ("qkv.bench.sections.plot",),
    "qkv.bench.prefill": ("qkv.bench.sections.prefill",),
    "qkv.bench.quality": ("qkv.bench.sections.quality",),
    "qkv.bench.roofline": ("qkv.bench.sections.roofline",),
    "qkv.bench.smollm2": ("qkv.bench.sections.smollm2",),
    "qkv.bench.startup": ("qkv.bench.sections.startup",),
    "qkv.bench.window_memory": ("qkv.bench.sections.window_memory",),
    "qkv.book_attention": ("qkv.book.attention",),
    "qkv.book_facts": ("qkv.book.facts",),
    "qkv.book_gpt": ("qkv.book.gpt",),
    "qkv.cache_integrity": ("qkv.util.cache_integrity",),
    "qkv.chunked_perplexity": ("qkv.eval.chunked_perplexity",),
    "qkv.cli.explain_keys": ("qkv.cli.explain.keys",),
    "qkv.cli.explain_model": ("qkv.cli.explain.model",),
    "qkv.cli.explain_why": ("qkv.cli.explain.why",),
    "qkv.cli.selection": ("qkv.cli.explain.selection",),
    "qkv.cli.walkthrough_view": ("qkv.cli.explain.walkthrough_view",),
    "qkv.empty_init": ("qkv.util.empty_init",),
    "qkv.kernel_names": ("qkv.names",),
    "qkv.long_text": ("qkv.util.long_text",),
    "qkv.models.book_keys": ("qkv.models.key_maps.book",),
    "qkv.models.checkpoint": ("qkv.models.hf.checkpoint",),
    "qkv.models.decoder_spec": ("qkv.models.configs.decoder_spec",),
    "qkv.models.families": ("qkv.models.configs.families",),
    "qkv.models.gguf_arch": ("qkv.models.gguf.arch",),
    "qkv.models.gguf_blocks": ("qkv.models.gguf.dequantize",),
    "qkv.models.gguf_config": ("qkv.models.gguf.config",),
    "qkv.models.gguf_header": ("qkv.models.gguf.header",),
    "qkv.models.gguf_kquants": ("qkv.models.gguf.kquants",),
    "qkv.models.gguf_stored": ("qkv.models.gguf.stored",),
    "qkv.models.gguf_tokenizer": ("qkv.models.gguf.tokenizer",),
    "qkv.models.gpt2_config": ("qkv.models.configs.gpt2",),
    "qkv.models.gpt2_tokenizer": ("qkv.models.hf.gpt2_tokenizer",),
    "qkv.models.hf_fields": ("qkv.models.configs.fields",),
    "qkv.models.hf_keys": ("qkv.models.key_maps.hf",),
    "qkv.models.key_map": ("qkv.models.key_maps.key_map",),
    "qkv.models.layer_spec": ("qkv.models.configs.layer_spec",),
    "qkv.models.llama_config": ("qkv.models.configs.llama",),
    "qkv.models.minilm": ("qkv.models.hf.minilm",),
    "qkv.models.packaged": ("qkv.models.hf.packaged",),
    "qkv.models.qwen": ("qkv.models.configs.qwen",),
    "qkv.models.rope_config": ("qkv.models.configs.rope",),
    "qkv.models.spec_keys": ("qkv.models.key_maps.spec",),
    "qkv.models.tokenizer_guard": ("qkv.models.hf.tokenizer_guard",),
    "qkv.models.untrusted": ("qkv.models.hf.untrusted",),
    "qkv.native": ("qkv.runtime.native",),
    "qkv.native.block_ops": ("qkv.runtime.native.block_ops",),
    "qkv.native.build": ("qkv.runtime.native.build",),
    "qkv.native.ops": ("qkv.runtime.native.ops",),
    "qkv.native.quantized_ops": ("qkv.runtime.native.quantized_ops",),
    "qkv.perf": ('qkv.runtime.linear', 'qkv.runtime.compile', 'qkv.bench.measure'),
    "qkv.perf.bandwidth": ("qkv.bench.measure.bandwidth",),
    "qkv.perf.block_linear": ("qkv.runtime.linear.block",),
    "qkv.perf.compile": ("qkv.runtime.compile",),
    "qkv.perf.float_linear": ("qkv.runtime.linear.float",),
    "qkv.perf.huge_pages": ("qkv.runtime.huge_pages",),
    "qkv.perf.prepared_cache": ("qkv.runtime.prepared_cache",),
    "qkv.perf.quantize": ("qkv.runtime.linear.quantized",),
    "qkv.perf.roofline": ("qkv.bench.measure.roofline",),
    "qkv.perf.timing": ("qkv.bench.measure.timing",),
    "qkv.runtime.native_layer_spec": ("qkv.runtime.layer_step_spec",),
    "qkv.runtime.native_layers": ("qkv.runtime.layer_step",),
    "qkv.perf.transposed": ("qkv.runtime.linear.transposed",),
    "qkv.perplexity": ("qkv.eval.perplexity",),
    "qkv.precision": ("qkv.names",),
    "qkv.progress": ("qkv.util.progress",),
    "qkv.sandbox": ("qkv.chat.sandbox",),
    "qkv.serve.answer": ("qkv.serve.api.answer",),
    "qkv.serve.app": ("qkv.serve.http.app",),
    "qkv.serve.connections": ("qkv.serve.http.connections",),
    "qkv.serve.explorer_page": ("qkv.serve.explorer.page",),
    "qkv.serve.explorer_why": ("qkv.serve.explorer.why",),
    "qkv.serve.front_door": ("qkv.serve.http.front_door",),
    "qkv.serve.json_body": ("qkv.serve.api.json_body",),
    "qkv.serve.kv_memory": ("qkv.serve.engine.kv_memory",),
    "qkv.serve.messages": ("qkv.serve.api.messages",),
    "qkv.serve.metrics": ("qkv.serve.http.metrics",),
    "qkv.serve.prefix_cache": ("qkv.serve.engine.prefix_cache",),
    "qkv.serve.prompt_worker": ("qkv.serve.engine.prompt_worker",),
    "qkv.serve.schemas": ("qkv.serve.api.schemas",),
    "qkv.serve.server": ("qkv.serve.http.server",),
    "qkv.serve.structured": ("qkv.serve.api.structured",),
    "qkv.serve.text": ("qkv.serve.engine.text",),
    "qkv.serve.tokenize": ("qkv.serve.api.tokenize",),
    "qkv.serve.tokens": ("qkv.serve.api.tokens",),
    "qkv.serve.tools": ("qkv.serve.api.tools",),
    "qkv.template_process": ("qkv.chat.template_process",),
    "qkv.terminal_text": ("qkv.util.terminal_text",),
    "qkv.text_file": ("qkv.util.text_file",),
    "qkv.threads": ("qkv.util.threads",),
    "qkv.trace.adapters": ("qkv.trace.record.adapters",),
    "qkv.trace.analysis": ("qkv.trace.explain.analysis",),
    "qkv.trace.attribution": ("qkv.trace.explain.attribution",),
    "qkv.trace.attribution_figures": ("qkv.trace.render.attribution_figures",),
    "qkv.trace.attribution_page": ("qkv.trace.render.attribution_page",),
    "qkv.trace.attribution_view": ("qkv.trace.render.attribution_view",),
    "qkv.trace.book_example": ("qkv.trace.record.book_example",),
    "qkv.trace.export": ("qkv.trace.record.export",),
    "qkv.trace.generation": ("qkv.trace.record.generation",),
    "qkv.trace.html": ("qkv.trace.render.html",),
    "qkv.trace.html_analysis": ("qkv.trace.render.html_analysis",),
    "qkv.trace.html_story": ("qkv.trace.render.html_story",),
    "qkv.trace.keys": ("qkv.trace.explain.keys",),
    "qkv.trace.keys_figures": ("qkv.trace.render.keys_figures",),
    "qkv.trace.keys_terminal": ("qkv.trace.render.keys_terminal",),
    "qkv.trace.notebook": ("qkv.trace.render.notebook",),
    "qkv.trace.patching": ("qkv.trace.explain.patching",),
    "qkv.trace.png": ("qkv.trace.render.png",),
    "qkv.trace.recorder": ("qkv.trace.record.recorder",),
    "qkv.trace.residual": ("qkv.trace.record.residual",),
    "qkv.trace.sink": ("qkv.trace.explain.sink",),
    "qkv.trace.terminal": ("qkv.trace.render.terminal",),
    "qkv.training.book_figure": ("qkv.training.book.figure",),
    "qkv.training.book_run": ("qkv.training.book.run",),
    "qkv.walkthrough": ("qkv.book.walkthrough",),
}
# names that were renamed on the way (old module -> {old name: (new module, new name)})
RENAMED: dict[str, dict[str, tuple[str, str]]] = {
    "qkv.kernel_names": {"Backend": ("qkv.names", "AttentionKernel"), "BACKENDS": ("qkv.names", "ATTENTION_KERNELS")},
    "qkv.runtime.native_layers": {"FusedLayers": ("qkv.runtime.layer_step", "NativeLayerStep")},
    "qkv.perf": {"quantize_blocks": ("qkv.runtime.linear.quantized", "quantize_groups")},
    "qkv.perf.quantize": {"quantize_blocks": ("qkv.runtime.linear.quantized", "quantize_groups")},
    "qkv.perf.compile": {"repeated_blocks": ("qkv.runtime.compile", "repeated_layers")},
}
_OLD_PACKAGES = frozenset(old for old in MOVED if any(other.startswith(old + ".") for other in MOVED))


class _MovedLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a plain new module, filled by exec_module

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        homes = MOVED[old]
        warnings.warn(f"{old} moved to {' and '.join(homes)}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=3)
        for home in homes:
            new = importlib.import_module(home)
            module.__dict__.update({k: v for k, v in vars(new).items() if not k.startswith("__")})
        for name, (home, new_name) in RENAMED.get(old, {}).items():
            setattr(module, name, getattr(importlib.import_module(home), new_name))
        if old in _OLD_PACKAGES:
            module.__path__ = []  # a package: its old submodules are found by _MovedFinder too


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds only the old paths in MOVED, after every real finder has said no."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(), is_package=fullname in _OLD_PACKAGES)


def install() -> None:
    """Answer the old paths (once per interpreter; `import qkv` calls this)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
