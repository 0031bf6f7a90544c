"""Masks and position ids for left-to-right language modelling (Megatron's ``get_ltor_masks_and_position_ids``)."""
from __future__ import annotations

import torch


def get_ltor_masks_and_position_ids(tokens: torch.Tensor, eod_token: int, reset_position_ids: bool,
                                    reset_attention_mask: bool, eod_mask_loss: bool
                                    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(attention_mask, loss_mask, position_ids) for ``tokens`` [batch, seq].

    - attention_mask: None unless ``reset_attention_mask`` (then plain causal attention applies).
      Otherwise bool [batch, 1, seq, seq], Megatron's convention: True where attention is NOT allowed;
      a query sees only earlier keys of its own document (a document ends with its eod token).
    - loss_mask: float [batch, seq], 0 at eod tokens when ``eod_mask_loss``.
    - position_ids: long [batch, seq], restarting at 0 after each eod when ``reset_position_ids``.
    """
    batch, seq = tokens.shape
    is_eod = tokens == eod_token
    loss_mask = torch.ones(tokens.shape, dtype=torch.float, device=tokens.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    positions = torch.arange(seq, dtype=torch.long, device=tokens.device).unsqueeze(0).expand(batch, seq)
    # document number of each token: eods strictly before it
    document = torch.cumsum(is_eod.long(), dim=1) - is_eod.long()
    if reset_position_ids:
        # a document starts one past the last eod strictly before the token (the eod ends its document)
        past_eod = torch.where(is_eod, positions + 1, torch.zeros_like(positions))
        past_earlier_eod = torch.cat([torch.zeros_like(past_eod[:, :1]), past_eod[:, :-1]], dim=1)
        position_ids = positions - torch.cummax(past_earlier_eod, dim=1).values
    else:
        position_ids = positions.clone()
    attention_mask = None
    if reset_attention_mask:
        causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril()
        same_document = document.unsqueeze(2) == document.unsqueeze(1)
        attention_mask = ~(causal & same_document).unsqueeze(1)
    return attention_mask, loss_mask, position_ids
