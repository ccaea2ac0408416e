"""The Hugging Face model families landmark attention converts, each declared by what its decoder
layer does differently from Llama's.

The in-sequence path runs the family's own modules (our attention function behind transformers'
registry); the memory path (``hf/backbone.py``) calls the same modules one piece at a time and
takes from the family here what to call in which order, so the two cannot drift. A family that
is not here, or a configuration we cannot read through a memory (a RoPE whose frequencies change
with the input's length, or that rotates part of each head; sliding-window layers), is refused in
one line.
"""

from dataclasses import dataclass

from ...core.rope import RotaryEmbedding

# RoPE types whose frequencies are fixed (what transformers' ROPE_INIT_FUNCTIONS compute once):
# a memory rotates blocks at positions of its choosing, so the frequencies cannot depend on how
# long the input is ("dynamic", "longrope" do)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class Family:
    """A decoder layout: Llama's unless a field says otherwise.

    name : str, as users name it; model_types : the ``config.model_type`` values it covers.
    qk_norm : None, "head" (an RMSNorm over each head's query and key, before RoPE: Qwen3) or
        "all" (over all heads' projections at once, before they are split: OLMo2).
    fused_qkv : one ``qkv_proj`` holds the query, key and value projections (Phi-3).
    post_norms : the norms follow the attention and the MLP (``post_attention_layernorm``,
        ``post_feedforward_layernorm``, no ``input_layernorm``: OLMo2), instead of preceding them.
    extra_parts : modules of the layer that change nothing at inference (Phi-3's residual dropouts).
    """

    name: str
    model_types: tuple[str, ...]
    qk_norm: str | None = None
    fused_qkv: bool = False
    post_norms: bool = False
    extra_parts: frozenset[str] = frozenset()

    @property
    def layer_parts(self) -> set[str]:
        """The children of a decoder layer of this family."""
        norms = {"post_attention_layernorm", "post_feedforward_layernorm"} if self.post_norms else {
            "input_layernorm", "post_attention_layernorm"}
        return {"self_attn", "mlp"} | norms | self.extra_parts

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
    Family("olmo2", ("olmo2",), qk_norm="all", post_norms=True),
    Family("phi3", ("phi3",), fused_qkv=True, extra_parts=frozenset({"resid_attn_dropout", "resid_mlp_dropout"})),
)


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
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in STATIC_ROPE:
        raise ValueError(f"{name} uses RoPE type {rope.get('rope_type')!r}, whose frequencies change with the input's "
                         f"length; a memory reads RoPE types {', '.join(STATIC_ROPE)} (rope_type 'default' is plain)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{name} rotates {rope['partial_rotary_factor']:.0%} of each head (partial_rotary_factor); "
                         "our kernels rotate every dimension of a retrieved block")
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        raise ValueError(f"{name} has sliding-window layers: landmark attention reads every layer through its "
                         "memory, so only models whose layers all attend to everything are converted")
    return family


def rotary_of(cfg, head_dim: int) -> tuple[RotaryEmbedding, float]:
    """The model's RoPE as a memory applies it (a pure rotation with the model's frequencies),
    and the factor the model multiplies cos and sin by (YaRN's attention factor; 1 otherwise),
    which multiplies every score by its square."""
    rope = cfg.rope_parameters
    if rope.get("rope_type", "default") == "default":
        return RotaryEmbedding(head_dim, float(rope["rope_theta"])), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    return RotaryEmbedding(head_dim, float(rope["rope_theta"]), inv_freq=inv_freq), float(factor)
