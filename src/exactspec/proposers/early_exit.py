"""Early-exit self-draft: the target's first L decoder layers, then its own final norm and
LM head, draft for the full model.

Source: Elhoushi et al. 2024, "LayerSkip" (arXiv 2404.16710), self-speculative decoding;
transformers calls it ``assistant_early_exit``. The draft shares every weight with the
target (no copy) but has its own KV cache of L layers, so it is a
:class:`~exactspec.proposers.draft_model.DraftModelProposer` over a second backend. A model
not trained for early exit drafts poorly (results/audit-2026-12-01-ee-cat-5000), which makes it a
good exerciser of rejection and residual resampling on a real model.
"""

from __future__ import annotations

import copy

from torch import nn

from exactspec.backends.base import Backend, UnsupportedModelError
from exactspec.backends.transformers_backend import TransformersBackend
from exactspec.proposers.draft_model import DraftModelProposer


def early_exit_model(model: nn.Module, num_layers: int) -> nn.Module:
    """A view of a transformers causal LM that runs only its first ``num_layers`` decoder
    layers, sharing all weights with ``model`` (which is left unchanged).

    Raises:
        ValueError: if ``num_layers`` is not in [1, number of layers − 1].
        UnsupportedModelError: if the model has no ``base_model.layers`` list.
    """
    base = model.base_model
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(f"{type(model).__name__} has no decoder layer list "
                                    "(base_model.layers): early exit is not supported")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) \
            or not 1 <= num_layers < len(layers):
        raise ValueError(f"early-exit layers = {num_layers!r} is invalid: it must be an integer "
                         f"in [1, {len(layers) - 1}] (the target has {len(layers)} layers)")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    draft_base = copy.copy(base)  # shallow: shares parameters, owns its module table
    draft_base._modules = dict(base._modules)
    draft_base.layers = nn.ModuleList(list(layers)[:num_layers])
    draft_base.config = config
    if base is model:
        return draft_base
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    setattr(draft, model.base_model_prefix, draft_base)
    draft.config = config
    return draft


class EarlyExitProposer(DraftModelProposer):
    """Drafts with the target's first ``num_layers`` layers (see module docstring).

    Args:
        target: the target's transformers backend.
        num_layers: L, decoder layers the draft runs (1 ≤ L < the target's layer count).
    Raises:
        ValueError, UnsupportedModelError: see :func:`early_exit_model`.
    """

    def __init__(self, target: Backend, num_layers: int) -> None:
        if target.name != "transformers":
            raise UnsupportedModelError("early-exit drafting needs the transformers backend "
                                        "(--backend transformers)")
        draft = TransformersBackend(early_exit_model(target.model, num_layers), target.tokenizer,
                                    target.eos_token_ids)
        super().__init__(draft, target)
        self.num_layers = num_layers
