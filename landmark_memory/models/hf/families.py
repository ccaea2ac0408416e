"""The Hugging Face model families landmark attention converts, each declared by what its decoder
layer does differently from Llama's.

The in-sequence path runs the family's own modules (our attention function behind transformers'
registry); the memory path (``hf/backbone.py``) calls the same modules one piece at a time and
takes from the family here what to call in which order, so the two cannot drift. A family that
is not here, or a configuration we cannot read through a memory (a RoPE whose frequencies change
with the input's length, or that rotates part of each head; sliding-window layers in a family
that does not declare them), is refused in one line.

Adding a family is a ``Family`` line in ``FAMILIES`` (and one in the tests' family list) when its
layer is Llama's with the differences the fields below name.
"""

from dataclasses import dataclass

from ...core.rope import RotaryEmbedding

# RoPE types whose frequencies are fixed (what transformers' ROPE_INIT_FUNCTIONS compute once):
# a memory rotates blocks at positions of its choosing, so the frequencies cannot depend on how
# long the input is ("dynamic", "longrope" do)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


NORMS = {  # where a family's decoder layer norms: the children that hold them
    "pre": {"input_layernorm", "post_attention_layernorm"},  # before the attention and the MLP (Llama)
    "post": {"post_attention_layernorm", "post_feedforward_layernorm"},  # after them (OLMo2)
    "sandwich": {"input_layernorm", "post_attention_layernorm",  # before and after both (Gemma 3)
                 "pre_feedforward_layernorm", "post_feedforward_layernorm"},
}


@dataclass(frozen=True)
class Family:
    """A decoder layout: Llama's unless a field says otherwise.

    name : str, as users name it; model_types : the ``config.model_type`` values it covers.
    qk_norm : None, "head" (an RMSNorm over each head's query and key, before RoPE: Qwen3,
        Gemma 3) or "all" (over all heads' projections at once, before they are split: OLMo2).
    fused_qkv : one ``qkv_proj`` holds the query, key and value projections (Phi-3).
    norms : a key of ``NORMS``: "pre" (Llama), "post" (OLMo2: the attention's and the MLP's
        outputs are normed, not their inputs) or "sandwich" (Gemma 3: both).
    sliding_layers : layers of type "sliding_attention" attend to their last
        ``config.sliding_window`` positions only (Gemma 3's local layers); they keep no memory.
    extra_parts : modules of the layer that change nothing at inference (Phi-3's residual dropouts).

    What the model's own modules do is theirs, on both paths: Gemma's embedding scale and its
    RMSNorm's ``1 + weight``, ``query_pre_attn_scalar`` as the attention's ``scaling``, a
    final logit soft-cap (``config.final_logit_softcapping``) applied by the backbone's head.
    """

    name: str
    model_types: tuple[str, ...]
    qk_norm: str | None = None
    fused_qkv: bool = False
    norms: str = "pre"
    sliding_layers: bool = False
    extra_parts: frozenset[str] = frozenset()

    @property
    def layer_parts(self) -> set[str]:
        """The children of a decoder layer of this family."""
        return {"self_attn", "mlp"} | NORMS[self.norms] | self.extra_parts

    @property
    def attention_parts(self) -> set[str]:
        """The children of a decoder layer's attention."""
        projections = {"qkv_proj"} if self.fused_qkv else {"q_proj", "k_proj", "v_proj"}
        return projections | {"o_proj"} | ({"q_norm", "k_norm"} if self.qk_norm else set())


FAMILIES = (
    Family("llama", ("llama",)),
    Family("mistral", ("mistral",)),
    Family("qwen2", ("qwen2",)),
    Family("qwen3", ("qwen3",), qk_norm="head"),
    Family("olmo2", ("olmo2",), qk_norm="all", norms="post"),
    Family("phi3", ("phi3",), fused_qkv=True, extra_parts=frozenset({"resid_attn_dropout", "resid_mlp_dropout"})),
    Family("gemma3", ("gemma3_text",), qk_norm="head", norms="sandwich", sliding_layers=True),
)

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer types


def family_of(model) -> Family:
    """The family of a transformers causal LM, checked against its layers and configuration;
    ``ValueError`` saying what is not supported otherwise."""
    cfg, name = model.config, type(model).__name__
    family = next((f for f in FAMILIES if cfg.model_type in f.model_types), None)
    supported = ", ".join(f.name for f in FAMILIES)
    if family is None:
        raise ValueError(f"{name} (model type {cfg.model_type!r}) is not a family landmark attention converts; "
                         f"supported: {supported}")
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None or not len(layers):
        raise ValueError(f"{name} has no decoder layers where a {family.name} model has them")
    parts = {n for n, _ in layers[0].named_children()}
    attn_parts = {n for n, _ in layers[0].self_attn.named_children()}
    if parts != family.layer_parts or attn_parts != family.attention_parts:
        raise ValueError(f"{name} is not the {family.name} layout we convert (decoder layer parts {sorted(parts)}, "
                         f"attention parts {sorted(attn_parts)}); supported: {supported}")
    for layer_type, rope in rope_parameters(cfg).items():
        where = f" ({layer_type} layers)" if layer_type else ""
        if rope.get("rope_type", "default") not in STATIC_ROPE:
            raise ValueError(f"{name} uses RoPE type {rope.get('rope_type')!r}{where}, whose frequencies change with "
                             "the "
                             f"input's length; a memory reads RoPE types {', '.join(STATIC_ROPE)} (rope_type 'default' "
                             "is plain)")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{name} rotates {rope['partial_rotary_factor']:.0%} of each head{where} "
                             "(partial_rotary_factor); our kernels rotate every dimension of a retrieved block")
    types = set(layer_types(cfg))
    if types - {FULL, SLIDING} or (SLIDING in types and not (family.sliding_layers and cfg.sliding_window)):
        raise ValueError(f"{name} has layers of types {sorted(types)}: a {family.name} model is converted when every "
                         "layer attends to everything (landmark attention reads them through its memory)"
                         + (", or to a sliding window of config.sliding_window positions" if family.sliding_layers
                            else ""))
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"{name} attends both ways (use_bidirectional_attention); landmark attention is causal")
    if FULL not in types:
        raise ValueError(f"{name} has no layer that attends to everything: it would keep no memory")
    return family


def layer_types(cfg) -> list[str]:
    """Per layer its attention type, ``FULL`` or ``SLIDING`` (every layer full unless the config
    lists them)."""
    return list(getattr(cfg, "layer_types", None) or [FULL] * cfg.num_hidden_layers)


def rope_parameters(cfg) -> dict[str | None, dict]:
    """The model's RoPE parameters, per layer type when they differ by type (Gemma 3: a local
    base for sliding layers, a global one for the others), else under ``None``."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    if set(rope) and set(rope) <= {FULL, SLIDING}:
        return dict(rope)
    return {None: rope}


def rotary_of(cfg, head_dim: int, layer_type: str = FULL) -> tuple[RotaryEmbedding, float]:
    """The RoPE of the model's layers of ``layer_type`` as a memory applies it (a pure rotation
    with the model's frequencies), and the factor the model multiplies cos and sin by (YaRN's
    attention factor; 1 otherwise), which multiplies every score by its square."""
    per_type = rope_parameters(cfg)
    key = layer_type if layer_type in per_type else None
    rope = per_type[key]
    if rope.get("rope_type", "default") == "default":
        return RotaryEmbedding(head_dim, float(rope["rope_theta"])), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu", **({"layer_type": key} if key else {}))
    return RotaryEmbedding(head_dim, float(rope["rope_theta"]), inv_freq=inv_freq), float(factor)
