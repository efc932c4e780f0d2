"""What Ollama's clients are told of a served model (:class:`ModelCard`): its names, size,
family, context length, what it can do, and its prompt as a template.

Clients decide from it what to ask: Continue fills in the middle only when ``template``
mentions ``.Suffix`` and takes its context length from ``parameters``' ``num_ctx`` line;
Copilot Chat offers a model for tools by ``capabilities`` and reads ``model_info``'s
``<family>.context_length``. Every value is one the server knows:

- ``context_length`` is what one request may hold here (``--max-seq-len``), not the length
  the model was trained for;
- ``size`` is the bytes of the weights as the server holds them;
- ``digest`` is the GGUF file's sha256 for a packaged model, else the sha256 of its source
  (what ``--model`` named; no file is hashed at request time);
- ``parameter_size`` is counted from the model's configuration;
- ``modified_at`` is when the model was loaded;
- ``template`` is the model's own chat template (Jinja, as infer renders it), and, for a
  model with fill-in-the-middle tokens, the fill in Ollama's template syntax around it.

A model not loaded yet is known by its names, its source and the size it is estimated to
take (:meth:`ModelCard.unloaded`); once loaded, by its engine (:meth:`ModelCard.of`) or its
embedder (:meth:`ModelCard.of_embedder`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from infer.api.fim import Layout
from infer.api.reasoning import CLOSE
from infer.api.tools import tool_format
from infer.models.config import ModelConfig
from infer.models.packaged import PACKAGED_MODELS

if TYPE_CHECKING:
    from infer.engine.config import EngineConfig
    from infer.engine.embed import Embedder
    from infer.engine.engine import Engine
    from infer.models.bert import BertConfig

# A GGUF file's quantization, as its name says it (Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf)
QUANTIZATION = re.compile(r"[-._]((?:I?Q\d\w*)|BF16|F16|F32)\.gguf$", re.IGNORECASE)
DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
PARAMETER_WIDTH = 30  # `ollama show` pads each parameter's name to this


@dataclass(frozen=True)
class ModelCard:
    """A served model, as Ollama's list, show and ps answers describe it.

    Args:
        names: The names it is served under (the first is its name).
        config: Its configuration (family, sizes); ``None`` until it is first loaded.
        context_length: The most tokens one request may hold here.
        size: Bytes of its weights, as held.
        digest: ``sha256:...`` (see the module's note).
        file_format: ``gguf`` or ``safetensors``.
        quantization: ``Q4_K_M``, ``BF16``...
        loaded_at: Unix time it was loaded.
        chat_template: Its chat template (``None``: prompts go as they are).
        fim: The text of its FIM prefix, suffix and middle tokens, if it has them.
        stops: The text of the tokens that end its replies.
        layout: How a fill's prompt is laid out (the server's choice).
        embeds: An embedding model (it generates no text).
        parameter_total: Its parameters, when not counted from ``config`` as a decoder's
            (an encoder's).
        expires_at: Unix time its keep-alive ends (``inf``: never).
    """

    names: tuple[str, ...]
    config: ModelConfig | None
    context_length: int
    size: int
    digest: str
    file_format: str
    quantization: str
    loaded_at: float
    chat_template: str | None
    fim: tuple[str, str, str] | None
    stops: tuple[str, ...]
    layout: Layout = Layout.PSM
    embeds: bool = False
    parameter_total: int | None = None
    expires_at: float = math.inf

    @classmethod
    def of(cls, engine: Engine, names: tuple[str, ...], layout: str) -> ModelCard:
        """The card of the model ``engine`` serves under ``names``, its fills laid out in
        ``layout`` (:class:`~infer.api.fim.Layout`)."""
        tokenizer, fim = engine.tokenizer, engine.fim

        def texts(token: int) -> str:
            return str(tokenizer.convert_ids_to_tokens(token))

        return cls(
            names=names,
            config=engine.model.config,
            context_length=engine.max_seq_len,
            size=engine.model_bytes,
            **_source(engine.config, engine.model_name),
            loaded_at=engine.loaded_at,
            chat_template=getattr(tokenizer, "chat_template", None) or None,
            fim=(texts(fim.prefix), texts(fim.suffix), texts(fim.middle)) if fim else None,
            stops=tuple(texts(i) for i in sorted(engine.eos_token_ids)),
            layout=Layout(layout),
        )

    @classmethod
    def of_embedder(
        cls, embedder: Embedder, names: tuple[str, ...], config: EngineConfig, size: int
    ) -> ModelCard:
        """The card of the embedding model ``embedder`` runs, loaded as ``config`` says and
        holding ``size`` bytes (its parameters counted from its configuration)."""
        hf, heads = embedder.loaded.config, embedder.loaded.config.num_attention_heads
        shape = ModelConfig(
            architecture="bert",  # Ollama's family of a BERT encoder (the only kind served)
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=hf.head_dim,
            max_position_embeddings=hf.max_position_embeddings,
        )
        return cls(
            names=names,
            config=shape,
            context_length=embedder.max_length,
            size=size,
            **_source(config, embedder.name),
            loaded_at=embedder.loaded_at,
            chat_template=None,
            fim=None,
            stops=(),
            embeds=True,
            parameter_total=_encoder_parameters(hf),
        )

    @classmethod
    def unloaded(cls, names: tuple[str, ...], config: EngineConfig, size: int) -> ModelCard:
        """What is known of a model not loaded yet: its names, its source, and the bytes it
        is estimated to take (``modified_at``: now)."""
        return cls(
            names=names,
            config=None,
            context_length=config.max_seq_len or 0,
            size=size,
            **_source(config, config.model),
            loaded_at=time.time(),
            chat_template=None,
            fim=None,
            stops=(),
        )

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def family(self) -> str:
        return self.config.family if self.config is not None else ""

    @property
    def tools(self) -> bool:
        """Whether its template writes tool calls (any model is offered tools, described
        in a system message where the template takes none)."""
        return tool_format(self.chat_template) != "generic"

    @property
    def thinking(self) -> bool:
        """Whether its replies may open a reasoning block."""
        return CLOSE in (self.chat_template or "")

    def capabilities(self) -> list[str]:
        """Ollama's capability names: ``insert`` where it fills in the middle; an embedding
        model's, ``embedding`` alone."""
        if self.embeds:
            return ["embedding"]
        wanted = {"tools": self.tools, "insert": self.fim is not None, "thinking": self.thinking}
        return ["completion", *(name for name, has in wanted.items() if has)]

    def template(self) -> str:
        """Its prompt as Ollama's ``template`` (Continue fills in the middle only for a
        template that mentions ``.Suffix``)."""
        chat = self.chat_template or "{{ .Prompt }}"
        if self.fim is None:
            return chat
        pre, suf, mid = self.fim
        prefix, suffix = f"{pre}{{{{ .Prompt }}}}", f"{suf}{{{{ .Suffix }}}}"
        fill = suffix + prefix if self.layout == Layout.SPM else prefix + suffix
        return f"{{{{- if .Suffix }}}}{fill}{mid}{{{{- else }}}}{chat}{{{{- end }}}}"

    def parameters(self) -> str:
        """Ollama's ``parameters``: a line per value, its name padded, its value as Go
        writes it (Continue reads ``num_ctx`` and each ``stop``)."""
        values = [("num_ctx", str(self.context_length))]
        values += [("stop", _quoted(s)) for s in self.stops]
        return "\n".join(f"{key:<{PARAMETER_WIDTH}} {value}" for key, value in values)

    def modelfile(self) -> str:
        """A Modelfile that describes it (``ollama show --modelfile``)."""
        lines = [
            "# Modelfile generated by infer",
            f"FROM {self.name}",
            f'TEMPLATE """{self.template()}"""',
            f"PARAMETER num_ctx {self.context_length}",
            *(f"PARAMETER stop {_quoted(s)}" for s in self.stops),
        ]
        return "\n".join(lines) + "\n"

    def parameter_count(self) -> int:
        """Its parameters, counted from its configuration (embeddings, attention, MLP and
        norms; a family's extra norms are left out); 0 while nothing is known of them."""
        if self.parameter_total is not None or self.config is None:
            return self.parameter_total or 0
        c = self.config
        hidden, q = c.hidden_size, c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        attention = hidden * q * 2 + hidden * kv * 2
        attention += (q + 2 * kv) * (c.qkv_bias or c.attention_bias) + hidden * c.attention_bias
        layer = attention + 3 * hidden * c.intermediate_size + 2 * hidden
        embeddings = c.vocab_size * hidden * (1 if c.tie_word_embeddings else 2)
        return embeddings + c.num_hidden_layers * layer + hidden

    def model_info(self) -> dict[str, object]:
        """Ollama's ``model_info``: GGUF's key names, under the model's family."""
        c, family = self.config, self.family
        general: dict[str, object] = {"general.basename": self.name}
        if c is None:
            return general
        return general | {
            "general.architecture": family,
            "general.parameter_count": self.parameter_count(),
            f"{family}.context_length": self.context_length,
            f"{family}.embedding_length": c.hidden_size,
            f"{family}.feed_forward_length": c.intermediate_size,
            f"{family}.block_count": c.num_hidden_layers,
            f"{family}.attention.head_count": c.num_attention_heads,
            f"{family}.attention.head_count_kv": c.num_key_value_heads,
            f"{family}.vocab_size": c.vocab_size,
        }


def _encoder_parameters(c: BertConfig) -> int:
    """A BERT encoder's parameters (its embeddings, layers and norms; no pooler)."""
    h, i = c.hidden_size, c.intermediate_size
    embeddings = (c.vocab_size + c.max_position_embeddings + c.type_vocab_size) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * (h * i) + i + h + 4 * h
    return embeddings + c.num_hidden_layers * layer


class _Source(TypedDict):
    digest: str
    file_format: str
    quantization: str


def _source(config: EngineConfig, name: str) -> _Source:
    """The digest, file format and quantization of a model named ``name`` loaded from
    ``config.model``."""
    packaged = PACKAGED_MODELS.get(name) or PACKAGED_MODELS.get(config.model)
    file = packaged.file if packaged is not None else name
    digest = packaged.sha256 if packaged else hashlib.sha256(config.model.encode()).hexdigest()
    found = QUANTIZATION.search(file) if config.weights == "auto" else None
    quantization = found[1].upper() if found else DTYPES.get(config.dtype, "")
    if config.weights in ("int8", "int4"):
        quantization = config.weights.upper()
    return {
        "digest": f"sha256:{digest}",
        "file_format": "gguf" if file.endswith(".gguf") else "safetensors",
        "quantization": quantization,
    }


def human_number(n: int) -> str:
    """A count as Ollama writes ``parameter_size`` (``494.03M``, ``8B``, ``1.5B``)."""
    for size, unit, decimals in ((10**9, "B", 1), (10**6, "M", 2), (10**3, "K", 0)):
        if n >= size:
            value = n / size
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.{decimals}f}{unit}"
    return str(n)


def _quoted(text: str) -> str:
    """A string as Go's ``%#v`` writes it (for the text of tokens, a JSON string)."""
    return json.dumps(text, ensure_ascii=False)
