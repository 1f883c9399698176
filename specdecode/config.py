"""DecoderConfig: every option of a SpeculativeDecoder, in one frozen dataclass, with the one
`validate()` that owns every rule between them.

The library (`SpeculativeDecoder(**options)`), the CLI (its flags build one, and a ValueError
exits 2 before any model loads), the server, the batch job and Ray workers (`asdict`, rebuilt in
the worker) all build this object; nothing else lists the options or checks a rule between them.
Request-level options (sampling, stops, lenience, ...) are not here: they belong to each request
(specdecode.frontend.builder); the one rule joining the two, lenience against the decoder's
verification, is `check_lenience`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, Literal, get_args

# Defaults, exact, chosen on HumanEval: free drafts first (suffix drafts measured 1.01-1.17x
# n-gram prompt lookup, docs/results/suffix_drafts.md); otherwise the draft, with int4 weights,
# scoring only the first 32768 ids, up to 8 tokens, stopping once it is less than 40% sure of its
# own token. Fixed γ ≤ 8 beat the adaptive schedule on 20 HumanEval prompts (2.26x against 2.07x,
# docs/results/bench_code_t0_fixed_gamma8.md); confidence 0.4 beat 0.2 and int4 tied int8 with a
# cheaper draft step (c 0.12 against 0.19, docs/results/tune_draft.md).
DEFAULT_GAMMA = 8
DEFAULT_DRAFT_CONFIDENCE = 0.4
DEFAULT_GAMMA_SCHEDULE = "fixed"
# Token-wise: block verification keeps more drafts in expectation, but at temperature 1 on 20
# HumanEval prompts it measured 2.59x against 2.61x (docs/results/bench_code_t1_20.md), within noise.
DEFAULT_VERIFICATION = "token"
DEFAULT_DRAFT_QUANTIZATION = "int4"

FreeDrafts = Literal["auto", "off", "suffix", "ngram"]
Quantization = Literal["auto", "none", "int8", "int4", "gguf"]
GammaSchedule = Literal["fixed", "adaptive"]
Verification = Literal["token", "block", "drafter-invariant"]
CrossVocab = Literal["auto", "tli", "slem"]
DType = Literal["auto", "bfloat16", "float32", "float16", "float64", "gguf"]
Backend = Literal["auto", "torch", "llama.cpp"]
DeviceMap = Literal["auto", "balanced", "balanced_low_0", "sequential"]

QUANTIZATION_BITS = {"int8": 8, "int4": 4}
# the most rows a llama.cpp model holds: llama.cpp's 256 sequences (LLAMA_MAX_SEQ), one kept for
# reading prompt logprobs apart from the rows
LLAMA_MAX_ROWS = 255


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy's too


def _one_of(name: str, value, kind) -> None:
    allowed = get_args(kind)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


@dataclass(frozen=True)
class DecoderConfig:
    """How a SpeculativeDecoder is built: the models, how drafts are made and verified (paper
    §2.1-2.3, §3.6; every option is exact), the guard (Cor. 3.9 at run time), the numerics, the
    placement and the batch. Every field has a default; `validate()` checks them together.

    Fields (each one's text is HELP[name], which the CLI's help and docs/api.md's table show too):
    """

    target: Any = "default"
    draft: Any = "default"
    draft_tokenizer: Any = None
    cross_vocab: CrossVocab = "auto"
    num_speculative_tokens: int = DEFAULT_GAMMA
    draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE
    gamma_schedule: GammaSchedule = DEFAULT_GAMMA_SCHEDULE
    verification: Verification = DEFAULT_VERIFICATION
    tree_width: int = 1
    tree_confidence: float = 0.8
    free_drafts: FreeDrafts = "auto"
    draft_vocab_limit: int | Literal["auto"] | None = "auto"
    quantize_draft: Quantization = "auto"
    guard: bool = True
    guard_costs: tuple[float, ...] | None = None
    dtype: DType = "auto"
    batch_invariant: bool | Literal["auto"] = "auto"
    backend: Backend = "auto"
    device: str | None = None
    device_map: DeviceMap | dict | None = None
    offload_folder: str | None = None
    max_batch_size: int | None = None
    max_model_len: int | None = None
    use_generation_config: bool = True

    @classmethod
    def from_options(cls, **options) -> "DecoderConfig":
        """A config from keyword options, old spellings included (each warns once, naming the new
        one): prompt_lookup=True/"suffix" → free_drafts="suffix", "ngram" → "ngram", False →
        "off", None → "auto"; quantize_draft=True → "int4", False → "none", None → "auto";
        dtype=None or a torch.dtype → its name; batch_invariant="on"/"off" (the CLI's words) → True/False.

        Raises:
            TypeError: an unknown option (named).
        """
        if "prompt_lookup" in options:
            old = options.pop("prompt_lookup")
            spellings = {True: "suffix", False: "off", None: "auto", "suffix": "suffix", "ngram": "ngram"}
            if not isinstance(old, (bool, str, type(None))) or old not in spellings:
                raise ValueError(f"prompt_lookup (now free_drafts) must be True, False, None, 'suffix' or 'ngram', "
                                 f"got {old!r}")
            new = spellings[old]
            if "free_drafts" in options:
                raise TypeError("give free_drafts or its old name prompt_lookup, not both")
            if old is not None:
                warnings.warn(f"prompt_lookup={old!r} is now free_drafts={new!r}", DeprecationWarning, stacklevel=3)
            options["free_drafts"] = new
        quantize = options.get("quantize_draft", "auto")
        if quantize is None or isinstance(quantize, bool):
            new = {None: "auto", True: DEFAULT_DRAFT_QUANTIZATION, False: "none"}[quantize]
            if quantize is not None:
                warnings.warn(f"quantize_draft={quantize!r} is now quantize_draft={new!r}", DeprecationWarning,
                              stacklevel=3)
            options["quantize_draft"] = new
        dtype = options.get("dtype", "auto")
        if dtype is None:
            options["dtype"] = "auto"
        elif not isinstance(dtype, str) and str(dtype).startswith("torch."):
            options["dtype"] = str(dtype).removeprefix("torch.")
        if options.get("batch_invariant") in ("on", "off"):  # the CLI's spellings
            options["batch_invariant"] = options["batch_invariant"] == "on"
        if options.get("draft") == "none":  # the CLI's spelling of plain decoding
            options["draft"] = None
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                            f"DecoderConfig takes {', '.join(sorted(names))}")
        return cls(**options)

    def validate(self) -> "DecoderConfig":
        """Check every field and every rule between fields; returns self.

        Raises:
            ValueError: the first field out of range, or the first pair of fields that clash
                (both named, with what to do).
        """
        if not _is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens (γ) must be an integer >= 1, got {self.num_speculative_tokens!r}")
        if not _is_number(self.draft_confidence) or not 0 <= self.draft_confidence < 1:
            raise ValueError(f"draft_confidence must be in [0, 1), got {self.draft_confidence!r}")
        for name, kind in (("gamma_schedule", GammaSchedule), ("verification", Verification),
                           ("cross_vocab", CrossVocab), ("free_drafts", FreeDrafts), ("quantize_draft", Quantization),
                           ("dtype", DType), ("backend", Backend)):
            _one_of(name, getattr(self, name), kind)
        if not _is_int(self.tree_width) or self.tree_width < 1:
            raise ValueError(f"tree_width must be an integer >= 1 (1 = a chain), got {self.tree_width!r}")
        if not _is_number(self.tree_confidence) or not 0 < self.tree_confidence <= 1:
            raise ValueError(f"tree_confidence must be in (0, 1], got {self.tree_confidence!r}")
        if self.draft_vocab_limit not in (None, "auto") and (
                not _is_int(self.draft_vocab_limit) or self.draft_vocab_limit < 1):
            raise ValueError(f"draft_vocab_limit must be a positive integer, 'auto' or None, "
                             f"got {self.draft_vocab_limit!r}")
        if self.guard_costs is not None and (
                not isinstance(self.guard_costs, (tuple, list)) or len(self.guard_costs) not in (2, 3)
                or not all(_is_number(x) and math.isfinite(x) and x >= 0 for x in self.guard_costs)):
            raise ValueError(f"guard_costs must be two or three finite numbers >= 0 (c, slope[, base]), "
                             f"got {self.guard_costs!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.max_batch_size is not None and (not _is_int(self.max_batch_size) or self.max_batch_size < 1):
            raise ValueError(f"max_batch_size must be None or an integer >= 1, got {self.max_batch_size!r}")
        if not (isinstance(self.batch_invariant, bool) or self.batch_invariant == "auto"):  # (1.0 == True)
            raise ValueError(f"batch_invariant must be True, False or 'auto', got {self.batch_invariant!r}")
        for name in ("guard", "use_generation_config"):
            if not isinstance(getattr(self, name), bool):  # guard="no" would be truthy: on
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.device_map, (dict, type(None))):
            _one_of("device_map", self.device_map, DeviceMap)
        self._check_combinations()
        return self

    def _check_combinations(self) -> None:
        given_target = not isinstance(self.target, str)
        if self.tree_width > 1 and self.verification != "token":
            raise ValueError("tree_width > 1 needs verification='token': token trees are verified by their own rule")
        if self.device_map is not None and (self.device is not None or given_target):
            raise ValueError("device_map places a target loaded by name or path; give it with no device and with "
                             "the target as a name or path")
        if self.device is not None and not str(self.device).startswith("cpu") \
                and self.quantize_draft in QUANTIZATION_BITS:
            raise ValueError(f"quantize_draft={self.quantize_draft!r} runs on the CPU only (the int8/int4 draft "
                             f"kernels are CPU kernels); on {self.device} use quantize_draft='auto' or 'none'")
        llama = self.uses_llama_cpp
        if llama and (self.device not in (None, "cpu") or self.device_map is not None):
            raise ValueError("the llama.cpp backend runs where llama-cpp-python was built for (the CPU here): "
                             "give it with no device or device_map")
        if (llama or self.quantize_draft == "gguf") and (self.max_batch_size or 0) > LLAMA_MAX_ROWS:
            raise ValueError(f"max_batch_size must be <= {LLAMA_MAX_ROWS} with the llama.cpp backend (llama.cpp holds "
                             f"at most {LLAMA_MAX_ROWS + 1} sequences, one kept for prompt logprobs), got "
                             f"{self.max_batch_size}")
        if llama and given_target:
            raise ValueError("the llama.cpp backend loads GGUF files by path or zoo name, not model objects; "
                             "pass backend='torch' for a loaded PreTrainedModel")
        if self.dtype == "gguf" and self.backend == "torch":
            raise ValueError("dtype='gguf' computes in the GGUF file's own quantization, which only the llama.cpp "
                             "backend runs; use backend='llama.cpp' (or 'auto') or a torch dtype")
        if self.backend == "llama.cpp" and self.dtype in ("float16", "float64"):
            raise ValueError(f"dtype={self.dtype!r} is a torch dtype; the llama.cpp backend takes 'auto', "
                             "'bfloat16', 'float32' or 'gguf'")
        if self.quantize_draft == "gguf" and (self.device not in (None, "cpu") or self.device_map is not None
                                              or (self.draft is not None and not isinstance(self.draft, str))):
            raise ValueError("quantize_draft='gguf' runs the draft's GGUF file on llama.cpp, on the CPU: give the "
                             "draft as a zoo name or a .gguf path, with no device or device_map")
        if self.batch_invariant is True and (self.dtype not in ("auto", "bfloat16", "gguf")
                                             or self.backend == "llama.cpp"):
            raise ValueError("batch_invariant=True runs the target with specdecode's own kernels (a bfloat16 target "
                             "on torch, or a GGUF file's own Q4_K/Q6_K blocks): use dtype 'auto', 'bfloat16' or "
                             "'gguf' and backend 'auto' or 'torch'")
        if llama and self.tree_width > 1:
            raise ValueError("token trees (tree_width > 1) need a custom attention mask, which the llama.cpp "
                             "backend does not have; use tree_width=1 or backend='torch'")

    @property
    def uses_llama_cpp(self) -> bool:
        """Whether the target runs on llama.cpp whatever the tuner measures (backend or dtype say so)."""
        return self.backend == "llama.cpp" or self.dtype == "gguf"

    def check_lenience(self, lenience: float) -> None:
        """A request's lenience (paper A.5; 1 is exact) against this decoder's verification.

        Raises:
            ValueError: lenience outside (0, 1], or below 1 with block verification or a tree.
        """
        if not _is_number(lenience) or not 0 < lenience <= 1:
            raise ValueError(f"lenience must be a number in (0, 1] (1 = exact; below 1 is lossy), got {lenience!r}")
        if lenience != 1 and self.verification != "token":
            raise ValueError(f"lenience {lenience} (lossy) needs verification='token'; this decoder verifies "
                             f"with the {self.verification!r} rule, which is exact only")
        if lenience != 1 and self.tree_width > 1:
            raise ValueError(f"lenience {lenience} (lossy) needs tree_width=1; token trees are verified exactly")

    @property
    def free_drafts_rule(self) -> str | None:
        """"suffix", "ngram" or None: which free drafts run ("auto": suffix drafts with a draft model)."""
        if self.free_drafts == "auto":
            return "suffix" if self.draft is not None else None
        return None if self.free_drafts == "off" else self.free_drafts

    def plain(self) -> dict:
        """The fields as plain values (dataclasses.asdict) for a config rebuilt in another process
        (a Ray worker): DecoderConfig(**config.plain()).

        Raises:
            ValueError: a field holds a model or tokenizer object, which cannot travel.
        """
        for name in ("target", "draft", "draft_tokenizer"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} is a {type(value).__name__} object; a config sent to another process "
                                 "needs names or paths")
        return dataclasses.asdict(self)


# One text per option: DecoderConfig's docstring, the CLI's help (cli.common, without the Markdown)
# and docs/api.md's table (tests/test_docs.py checks it against markdown_table()) all show these.
HELP = {
    "target": "the zoo pair's target, a zoo name (`qwen2.5-coder-1.5b-instruct`, `qwen2.5-coder-0.5b-instruct`, "
              "`smollm2-135m-instruct`), a local directory saved with `save_pretrained`, a GGUF file, a hub id "
              "(needs a hub), or a loaded `PreTrainedModel` (then pass `tokenizer=`)",
    "draft": "the same forms, or `None` for plain decoding through the same loop",
    "draft_tokenizer": "the draft's tokenizer (an object, a name or a path) where it is not the target's; a draft "
                       "whose tokenizer differs from the target's proposes through the token strings both "
                       "vocabularies hold, exactly",
    "cross_vocab": "for a draft of another vocabulary: `\"auto\"` (TLI for sampled requests, SLEM for greedy "
                   "ones), `\"tli\"` or `\"slem\"` for every request "
                   "([draft sources](draft-sources.md#a-draft-of-another-vocabulary-tli-and-slem))",
    "num_speculative_tokens": "γ, the most drafts per target call (≥ 1); `dtype=\"auto\"` may lower it for this "
                              "machine",
    "draft_confidence": "stop drafting once the draft is less sure than this of its own token, in [0, 1); 0 always "
                        "drafts γ",
    "gamma_schedule": "`\"fixed\"`: up to γ every step; `\"adaptive\"`: start at 4, +2 after a fully accepted "
                      "block, −1 otherwise, within [1, γ]",
    "verification": "`\"token\"` (paper §2.3), `\"block\"` (block verification, Sun et al.: never fewer accepted "
                    "drafts in expectation, the same output when greedy) or `\"drafter-invariant\"` (an "
                    "exponential race keyed by the seed and position: a seeded sampled request gives the same "
                    "tokens with or without drafts; "
                    "[exactness](exactness.md#seeded-sampling-that-does-not-depend-on-the-drafts-verificationdrafter-invariant))",
    "tree_width": "draft a token tree with up to this many candidates where the draft is unsure, scored in the "
                  "same target call and verified exactly; 1 drafts a chain (a tree needs `verification=\"token\"`, "
                  "the target's tokenizer and a torch target)",
    "tree_confidence": "branch where the draft is less sure than this of its token, in (0, 1]",
    "free_drafts": "drafts that cost no model, tried first, the draft model serving the other steps: `\"suffix\"` "
                   "(the most frequent continuation of the last tokens in the prompt, the output and earlier "
                   "requests), `\"ngram\"` (prompt lookup), `\"off\"`; `\"auto\"` is `\"suffix\"` with a draft model "
                   "and `\"off\"` without one",
    "draft_vocab_limit": "the draft scores only ids below this (a cheaper LM head); `None` the whole vocabulary; "
                         "`\"auto\"` 32768 for the zoo's draft, `None` for others",
    "quantize_draft": "`\"int4\"` (groups of 32), `\"int8\"` (per-row scales), `\"none\"`; `\"gguf\"`: the draft's "
                      "GGUF file as it is, on llama.cpp; `\"auto\"`: int4 for a draft loaded by name or path on the "
                      "CPU (its GGUF file with a llama.cpp target), none otherwise (with `dtype=\"auto\"` the "
                      "draft's kernels are timed against each other)",
    "guard": "pause drafting while the acceptances say it does not pay (paper Cor. 3.9 at run time, with costs "
             "the loop measures as it runs); seeded sampled requests under the token rule are never paused",
    "guard_costs": "the guard's starting (c, slope) or (c, slope, base): a call verifying k drafts costs "
                   "1 + base + slope·k target steps; `None` takes them from the choice's timings, or times a few "
                   "forwards at load",
    "dtype": "the measured choice on the CPU ([auto-configuration](auto-configuration.md)); `\"bfloat16\"`, "
             "`\"float32\"`, `\"float16\"`, `\"float64\"`: torch in that dtype, honoured as given; `\"gguf\"`: the "
             "GGUF file's own quantization, on llama.cpp or (a Qwen2 file of Q4_K/Q6_K blocks) on specdecode's "
             "batch-invariant kernels, whichever the timings favour "
             "([llamacpp.md](llamacpp.md#the-files-own-blocks-on-specdecodes-kernels))",
    "batch_invariant": "each token's logits the same bits alone, in a verify or beside other rows: greedy "
                       "speculative output = plain greedy output of the same model, token for token "
                       "([exactness](exactness.md#numerics-batch-invariance-and-bfloat16-near-ties-elsewhere)); "
                       "`\"auto\"`: a bfloat16 Llama/Qwen2 target on torch on the CPU where specdecode's kernels "
                       "build (always with `dtype=\"bfloat16\"`, with `\"auto\"` when within 5% of the fastest), "
                       "and with `dtype=\"gguf\"` a Qwen2 file's own Q4_K/Q6_K blocks where those kernels are "
                       "within 5% of llama.cpp; `True` (`\"on\"`): required (ValueError where it cannot run); "
                       "`False` (`\"off\"`): never",
    "backend": "`\"torch\"` or `\"llama.cpp\"` (GGUF files through llama-cpp-python: [llamacpp.md](llamacpp.md)); "
               "`\"auto\"`: `dtype` decides",
    "device": "where a model object is, else `\"cpu\"`; `\"cpu\"`, `\"cuda\"`, `\"cuda:N\"`, `\"mps\"`",
    "device_map": "spread a target loaded by name or path over devices: `\"auto\"`, `\"balanced\"`, "
                  "`\"balanced_low_0\"`, `\"sequential\"` or a `{module: device}` dict (transformers' "
                  "`device_map`); the draft runs on the target's first device",
    "offload_folder": "where accelerate keeps `\"disk\"` layers of a `device_map`",
    "max_batch_size": "the most requests decoded together (`None`: no limit)",
    "max_model_len": "the most tokens a request may hold, prompt and output together, below the target's own "
                     "context window (`None`: the window): a longer prompt is refused (`ValueError`; 400 in the "
                     "server), an output stops there (`finish_reason` `\"length\"`)",
    "use_generation_config": "apply the target's `generation_config` values that can be applied exactly "
                             "(repetition_penalty, no_repeat_ngram_size); others are named in a warning",
}


def plain_text(markdown: str) -> str:
    """A HELP text without its Markdown (links kept as their words, no backticks): for --help."""
    import re

    return re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", markdown).replace("`", "")


def default_text(name: str) -> str:
    """A field's default as docs/api.md's table shows it (`"auto"`, 8, `None`, ...)."""
    value = next(f.default for f in dataclasses.fields(DecoderConfig) if f.name == name)
    return f'`"{value}"`' if isinstance(value, str) else f"`{value}`" if value is None or isinstance(value, bool) \
        else str(value)


def markdown_table() -> str:
    """docs/api.md's table of DecoderConfig's options, from HELP and the defaults."""
    rows = [f"| `{f.name}` | {default_text(f.name)} | {HELP[f.name]} |" for f in dataclasses.fields(DecoderConfig)]
    return "\n".join(["| option | default | what it does |", "|---|---|---|", *rows])


DecoderConfig.__doc__ = DecoderConfig.__doc__.rstrip(" ") + "".join(f"    {f.name} (default {plain_text(default_text(f.name))}): {plain_text(HELP[f.name])}\n"
                                 for f in dataclasses.fields(DecoderConfig))
