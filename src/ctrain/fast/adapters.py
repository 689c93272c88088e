"""LoRA adapters that read one input, computed together on the fast engine.

q/k/v read the same normed hidden state, and so do gate/up. PEFT gives each projection its own
adapter input cast, dropout and ``A`` matmul: three passes over the same ``tokens x hidden`` input
in the forward pass and three more in the backward pass, each as large as the input. A group
draws one dropout mask, runs one ``A`` matmul with the members' ``A`` weights stacked (rank 48
for q/k/v at r16), and gives each member its slice; its ``B`` matmul and the frozen base stay
its own. Without dropout that is the same arithmetic as PEFT's; with dropout the members share
one mask instead of drawing three (each entry still dropped with probability p).

The adapters' weights, names and state dict do not change: checkpoints, resume, merging and
evaluation see PEFT's modules as they are (their classes become subclasses that only add the
hand-over). A group falls back to PEFT's own forward whenever it is not plain LoRA on one active
adapter (merged, disabled, DoRA, extra arguments, ...).
"""

from __future__ import annotations

from typing import Any

__all__ = ["GROUPS", "group_adapters"]

# Projections of one module that read the same input: the module's first argument.
GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

# One subclass per class swapped in, made once: the class, not each module, carries the new
# forward, so the compiler sees one forward for every layer (a per-module wrapper object made it
# compile each layer again, up to its recompile limit, and run the rest uncompiled).
_SUBCLASSES: dict[tuple[type, str], type] = {}


def _is_lora_linear(module: Any) -> bool:
    return module is not None and hasattr(module, "lora_A") and hasattr(module, "lora_B") and hasattr(
        module, "base_layer"
    )


def _subclass(cls: type, role: str) -> type:
    key = (cls, role)
    if key not in _SUBCLASSES:
        forward = _parent_forward(cls) if role == "parent" else _member_forward(cls)
        _SUBCLASSES[key] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    return _SUBCLASSES[key]


def group_adapters(model: Any) -> int:
    """Compute the adapters of projections that share an input together (see the module's
    docstring); returns how many groups. Before compiling: the compiled layers trace the groups."""
    count = 0
    for parent in list(model.modules()):
        children = dict(parent.named_children())
        groups = tuple(names for names in GROUPS if all(_is_lora_linear(children.get(n)) for n in names))
        if not groups or getattr(parent, "_ctrain_groups", None) is not None:
            continue
        parent.__class__ = _subclass(type(parent), "parent")
        parent._ctrain_groups = groups
        for names in groups:
            for name in names:
                member = children[name]
                member.__class__ = _subclass(type(member), "member")
                member._ctrain_input = member._ctrain_output = None
        count += len(groups)
    return count


def _adapter(members: list[Any]) -> str | None:
    """The one active adapter the members share when the group can compute it as plain LoRA."""
    if not all(_is_lora_linear(member) for member in members):
        return None
    active = list(members[0].active_adapters)
    if len(active) != 1:
        return None
    name = active[0]
    dropout = members[0].lora_dropout[name]
    for member in members:
        if member.disable_adapters or member.merged or list(member.active_adapters) != active:
            return None
        if name not in member.lora_A or name in getattr(member, "lora_variant", {}):
            return None
        if member.lora_A[name].bias is not None or member.lora_B[name].bias is not None:
            return None
        other = member.lora_dropout[name]
        if type(other) is not type(dropout) or getattr(other, "p", None) != getattr(dropout, "p", None):
            return None
    return name


def _parent_forward(cls: type) -> Any:
    import inspect

    # The shared input is the forward's first argument, passed by position or by name (transformers'
    # decoder layers call self_attn(hidden_states=...), mlp(hidden_states)).
    first = list(inspect.signature(cls.forward).parameters)[1]

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        """The groups' outputs for this call's input, handed to the members, then the module's own forward."""
        x = args[0] if args else kwargs.get(first)
        handed = []
        if x is not None:
            for names in self._ctrain_groups:
                members = [getattr(self, name) for name in names]
                adapter = _adapter(members)
                if adapter is None:
                    continue
                for member, out in zip(members, _outputs(members, adapter, x), strict=True):
                    member._ctrain_input, member._ctrain_output = x, out
                    handed.append(member)
        try:
            return cls.forward(self, *args, **kwargs)
        finally:
            for member in handed:  # hold no tensor past the call
                member._ctrain_input = member._ctrain_output = None

    return forward


def _member_forward(cls: type) -> Any:
    def forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        """The output the group computed for ``x``, once; anything else is PEFT's own forward."""
        out = self._ctrain_output
        if out is not None and x is self._ctrain_input and not args and not kwargs:
            self._ctrain_input = self._ctrain_output = None
            return out
        return cls.forward(self, x, *args, **kwargs)

    return forward


def _outputs(members: list[Any], name: str, x: Any) -> list[Any]:
    """Every member's output for input ``x``: base + scaling * B(A(dropout(x))), with one dropout
    and one matmul for all the members' A."""
    import torch
    import torch.nn.functional as F

    weights = [member.lora_A[name].weight for member in members]
    h = members[0].lora_dropout[name](x.to(weights[0].dtype))  # PEFT casts the adapter input the same way
    z = F.linear(h, torch.cat(weights))
    outputs = []
    for member, part in zip(members, z.split([w.shape[0] for w in weights], dim=-1), strict=True):
        base = member.base_layer(x)
        outputs.append((base + member.lora_B[name](part) * member.scaling[name]).to(base.dtype))
    return outputs
