"""DAPO's dynamic sampling (Yu et al. 2025, https://arxiv.org/abs/2503.14476) for train_grpo.py: a group whose G
scores are all equal carries no advantage to learn from, so an iteration samples fresh rounds of groups until it has
enough informative ones (docs/design.md §5b). Sampling bookkeeping, not a formula of the update: the stage's
--dynamic-sampling calls dynamic_sampling after its first rollout round."""

from typing import Callable

import torch

import parallel


def informative_groups(scores, group_size: int) -> torch.Tensor:
    """scores (N,) -> (N / G,) bool: the group's scores are not all equal (DAPO's dynamic sampling keeps these: a group
    of ties has no advantage to learn from)."""
    grouped = scores.view(-1, group_size)  # (N / G, G)
    return (grouped != grouped[:, :1]).any(1)


def concat_experience(parts: list[dict], pad_id: int) -> dict:
    """Experience dicts of different widths -> one: prompts left-padded (query with pad_id, query_mask with 0; position
    ids follow the attention mask, so more left padding changes nothing), responses right-padded with pad_id, every
    other (B, T) tensor right-padded with 0, (B,) tensors concatenated."""
    merged = {}
    for key in parts[0]:
        tensors = [part[key] for part in parts]
        if tensors[0].dim() == 1:
            merged[key] = torch.cat(tensors)
            continue
        width = max(tensor.size(1) for tensor in tensors)
        value = pad_id if key in ("query", "response") else 0
        padded = []
        for tensor in tensors:
            extra = width - tensor.size(1)
            left = extra if key in ("query", "query_mask") else 0
            padded.append(torch.nn.functional.pad(tensor, (left, extra - left), value=value))
        merged[key] = torch.cat(padded)
    return merged


def keep_informative_groups(rounds: list[dict], group_size: int, rows: int, pad_id: int) -> dict:
    """Dynamic sampling (DAPO) over the experiences of one iteration's rollout rounds: the first rows / group_size
    informative groups, in round order; when there are fewer, the first round's other groups fill the batch. The
    result has `rows` rows and a row flag "informative" (1.0, or 0.0 for the filling: no policy loss)."""
    parts = []
    kept = 0
    for experience in rounds:
        flags = informative_groups(experience["scores"], group_size).repeat_interleave(group_size)  # (B,)
        index = flags.nonzero().squeeze(1)
        parts.append({key: value[index] for key, value in experience.items()})
        kept += len(index)
    kept = min(kept, rows)
    first_flags = informative_groups(rounds[0]["scores"], group_size).repeat_interleave(group_size)
    filling = (~first_flags).nonzero().squeeze(1)[: rows - kept]
    parts.append({key: value[filling] for key, value in rounds[0].items()})
    experience = {key: value[:rows] for key, value in concat_experience(parts, pad_id).items()}
    device = experience["mask"].device
    experience["informative"] = torch.cat([torch.ones(kept, device=device), torch.zeros(rows - kept, device=device)])
    return experience


def dynamic_sampling(first: dict, draw: Callable, args, prompts_per_rank: int, pad_id: int) -> tuple[dict, dict]:
    """DAPO's dynamic sampling after the iteration's first rollout round: draw() (the next round: experience, metrics,
    records) until every rank has prompts_per_rank informative groups or --max-sample-rounds rounds are spent;
    returns the experience keep_informative_groups builds and rollout/zero_std_frac (of the first round),
    rollout/sample_rounds."""
    device = first["mask"].device
    rounds = [first]
    group_flags = informative_groups(first["scores"], args.group_size)
    counts = parallel.all_reduce_dict({"groups": len(group_flags), "zero_std": (~group_flags).sum()}, device)
    metrics = {"rollout/zero_std_frac": counts["zero_std"] / counts["groups"]}
    while len(rounds) < args.max_sample_rounds:
        informative = sum(informative_groups(part["scores"], args.group_size).sum() for part in rounds)
        short = parallel.all_reduce_dict({"ranks_short": float(informative < prompts_per_rank)}, device)
        if short["ranks_short"] == 0:
            break
        rounds.append(draw()[0])
    metrics["rollout/sample_rounds"] = len(rounds)
    rows = first["mask"].size(0)
    return keep_informative_groups(rounds, args.group_size, rows, pad_id), metrics
