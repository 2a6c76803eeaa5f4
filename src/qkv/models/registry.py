"""Which model a config.json describes: one `Family` per model_type, with its
architectures, the config reader, the model it builds and its key map.

An unknown model_type or architecture is refused in one line that names it and lists what
qkv loads, before anything else is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from qkv.errors import QkvError
from qkv.models.configs import families
from qkv.models.key_maps import hf as hf_keys
from qkv.models.key_maps import spec as spec_keys
from qkv.models.decoder import CausalDecoder
from qkv.models.configs.decoder_spec import DecoderSpec
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig
from qkv.models.configs.qwen import Qwen2Config, Qwen3Config
from qkv.models.spec_decoder import SpecDecoder


@dataclass(frozen=True)
class Family:
    """One model_type: its architectures, the validated config, the model, its key map."""

    architectures: tuple[str, ...]
    parse: Callable[[dict[str, Any]], Any]  # config.json -> validated config (ValueError if not)
    build: Callable[[Any], CausalDecoder]
    mapping: Callable[[Any], tuple[list[hf_keys.KeyMap], re.Pattern[str], dict[str, str]]]  # from the spec
    rename: Callable[[Iterable[str]], Callable[[str], str]] = lambda names: lambda name: name


def _parse_gpt2(config: dict[str, Any]) -> tuple[GPTConfig, bool]:
    tie = config.get("tie_word_embeddings", True)
    if not isinstance(tie, bool):
        raise ValueError(f"tie_word_embeddings must be true or false, got {tie!r}")
    return GPTConfig.from_hf_config(config), tie


def _build_gpt2(spec: tuple[GPTConfig, bool]) -> GPT2Decoder:
    cfg, tie = spec
    model = GPT2Decoder(cfg)
    if tie:
        model.tie_weights()
    return model


def _gpt2_mapping(spec: tuple[GPTConfig, bool]) -> tuple[list[hf_keys.KeyMap], re.Pattern[str], dict[str, str]]:
    cfg, tie = spec
    tied = {"lm_head.weight": "transformer.wte.weight"} if tie else {}
    return hf_keys.gpt2_key_maps(cfg, tie), hf_keys.GPT2_BUFFERS, tied


def _gpt2_rename(names: Iterable[str]) -> Callable[[str], str]:
    if any(k.startswith("transformer.") for k in names):
        return lambda name: name
    # Saved from GPT2Model (no head): the same names without the "transformer." prefix.
    return lambda name: name if name.startswith("lm_head.") else f"transformer.{name}"


def _llama_mapping(cfg: LlamaConfig) -> tuple[list[hf_keys.KeyMap], re.Pattern[str], dict[str, str]]:
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_word_embeddings else {}
    return hf_keys.llama_key_maps(cfg), hf_keys.LLAMA_BUFFERS, tied


def _spec_mapping(spec: DecoderSpec) -> tuple[list[hf_keys.KeyMap], re.Pattern[str], dict[str, str]]:
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if spec.tie_word_embeddings else {}
    skip = spec_keys.GEMMA3_VISION if spec.model_type == "gemma3_text" else spec_keys.BUFFERS
    return spec_keys.spec_key_maps(spec), skip, tied


def _spec_family(architectures: tuple[str, ...], parse: Callable[[dict[str, Any]], DecoderSpec],
                 rename: Callable[[Iterable[str]], Callable[[str], str]] | None = None) -> Family:
    if rename is None:
        return Family(architectures, parse, SpecDecoder, _spec_mapping)
    return Family(architectures, parse, SpecDecoder, _spec_mapping, rename)


FAMILIES: dict[str, Family] = {
    "gpt2": Family(("GPT2LMHeadModel", "GPT2Model"), _parse_gpt2, _build_gpt2, _gpt2_mapping, _gpt2_rename),
    "llama": Family(("LlamaForCausalLM",), LlamaConfig.from_hf_config, LlamaForCausalLM, _llama_mapping),
    "qwen2": Family(("Qwen2ForCausalLM",), Qwen2Config.from_hf_config, LlamaForCausalLM, _llama_mapping),
    "qwen3": Family(("Qwen3ForCausalLM",), Qwen3Config.from_hf_config, LlamaForCausalLM, _llama_mapping),
    "mistral": _spec_family(("MistralForCausalLM",), families.mistral_spec),
    "phi3": _spec_family(("Phi3ForCausalLM",), families.phi3_spec),
    "gemma2": _spec_family(("Gemma2ForCausalLM",), families.gemma2_spec),
    "gemma3_text": _spec_family(("Gemma3ForCausalLM",), families.gemma3_text_spec),
    "gemma3": _spec_family(("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM"), families.gemma3_text_spec,
                           spec_keys.gemma3_rename),
    "olmo2": _spec_family(("Olmo2ForCausalLM",), families.olmo2_spec),
    "smollm3": _spec_family(("SmolLM3ForCausalLM",), families.smollm3_spec),
}


def family_of(config: dict[str, Any], source: str) -> Family:
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise QkvError(f"{source}: config.json's architectures must be a list of names, got {str(architectures)[:60]}")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    known = ", ".join(a for f in FAMILIES.values() for a in f.architectures[:1])
    if family is None:
        raise QkvError(
            f"{source}: unknown architecture {architectures[:3] or '?'} (model_type {str(model_type)[:40]!r}); "
            f"qkv loads {known}"
        )
    odd = [a for a in architectures if a not in family.architectures]
    if odd:
        raise QkvError(f"{source}: unknown architecture {', '.join(odd[:3])} for model_type {model_type!r}; qkv loads {known}")
    return family
