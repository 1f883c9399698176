"""The speculative sampling rule (paper §2.3, Algorithm 1; proof in Appendix A.1).

Glossary: the *draft* proposes k tokens x_1..x_k sampled from q_1..q_k; the *target* gives
p_1..p_{k+1} in one call. Token x_i is *accepted* with probability min(1, p_i(x_i) / q_i(x_i));
the first rejection ends the block and its replacement is drawn from the *residual*
norm(max(0, p_i − q_i)); if all k are accepted, a *bonus* token is drawn from p_{k+1}. Every
call therefore yields between 1 and k+1 tokens, distributed exactly as sampling p alone.

Pure functions of tensors: no model, no cache, no global RNG (pass a torch.Generator).
"""

from __future__ import annotations

import math

import torch

from specdecode.sampling import first_argmax, race


def _check_shapes(draft_tokens, draft_probs, target_probs):
    if (draft_tokens.dim() != 2 or draft_probs.dim() != 3 or target_probs.dim() != 3
            or draft_probs.shape[:2] != draft_tokens.shape
            or target_probs.shape[:2] != (draft_tokens.shape[0], draft_tokens.shape[1] + 1)):
        raise ValueError(
            "expected draft_tokens [B, k], draft_probs [B, k, V_draft], target_probs [B, k+1, V]; got "
            f"{tuple(draft_tokens.shape)}, {tuple(draft_probs.shape)}, {tuple(target_probs.shape)}")


def match_vocab(draft_probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Zero-pad (or cut) q to the target's vocabulary size (docs/exactness.md rule 6).

    Models of one family often pad their embedding tables to different sizes; the ids past the
    tokenizer's real size are never valid tokens, so q mass there can never be accepted.
    """
    v_draft = draft_probs.shape[-1]
    if v_draft < vocab_size:
        return torch.nn.functional.pad(draft_probs, (0, vocab_size - v_draft))
    return draft_probs[..., :vocab_size]


def acceptance_probs(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                     target_probs: torch.Tensor, lenience: float = 1.0) -> torch.Tensor:
    """Probability of accepting each drafted token, min(1, p_i(x_i) / (l·q_i(x_i))) (paper §2.3, A.5).

    Args:
        draft_tokens: [B, k] int64.
        draft_probs:  [B, k, V_draft] float32, q.
        target_probs: [B, k(+1), V] float32, p; only the first k positions are used.
        lenience: l in (0, 1]; 1 is the exact rule, l < 1 is lossy (paper A.5).
    Returns:
        [B, k] float32 in [0, 1]. A drafted id with q = 0 (a bug upstream: it cannot have been
        sampled) or an id outside the target's vocabulary gets 0: rejected, never NaN.
    """
    vocab_size = target_probs.shape[-1]
    k = draft_tokens.shape[1]
    in_vocab = draft_tokens < vocab_size
    index = torch.where(in_vocab, draft_tokens, 0).unsqueeze(-1)
    p_x = target_probs[:, :k].gather(-1, index).squeeze(-1)
    q_x = draft_probs.gather(-1, draft_tokens.clamp(max=draft_probs.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    valid = in_vocab & (q_x > 0)
    ratio = p_x / torch.where(valid, lenience * q_x, 1.0)
    return torch.where(valid, ratio.clamp(max=1.0), 0.0)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                          weight: torch.Tensor | float | None = None) -> torch.Tensor:
    """norm(max(0, w·p − q)) per token id: where the replacement token is drawn after a rejection
    (paper §2.3, Algorithm 1 step 4: w = 1), or after block verification keeps i drafts (w = w_i,
    see the block section below).

    Args:
        target_probs: [..., V] float32, p.   draft_probs: [..., V_draft] float32, q.
        weight: None (w = 1), or [...] float (or a number), w in [0, 1].
    Returns:
        [..., V] float32, normalized. Where w·p − q has no positive mass (p = q up to rounding,
        when a rejection, or a stop there, has probability 0 anyway) it falls back to p, so it
        is never NaN.
    """
    scaled = target_probs
    if weight is not None:
        scaled = torch.as_tensor(weight, dtype=target_probs.dtype, device=target_probs.device).unsqueeze(-1) \
            * target_probs
    residual = (scaled - match_vocab(draft_probs, target_probs.shape[-1])).clamp(min=0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / torch.where(mass > 0, mass, 1.0), target_probs)


def speculative_step(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                     target_probs: torch.Tensor, generator: torch.Generator | None = None,
                     lenience: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep a prefix of the draft, then sample one token (paper §2.3, Algorithm 1).

    Args:
        draft_tokens: [B, k] int64; token i was sampled from draft_probs[:, i].
        draft_probs:  [B, k, V_draft] float32, q; rows sum to 1; zero-padded to V if smaller.
        target_probs: [B, k+1, V] float32, p; row k is used only if all k are kept.
        generator: the request's torch.Generator (CPU); draws k uniforms, then one sample.
        lenience: 1.0 is exact; l < 1 accepts with min(1, p/(l·q)) and is lossy (paper A.5),
            with the residual unchanged, so no token gets more than p(x)/l.
    Returns:
        num_accepted: [B] int64 in [0, k].
        next_token:   [B] int64 from norm(max(0, p − q)) at the first rejection, else from p[:, k].
    Raises:
        ValueError: if shapes disagree (all three are printed) or lenience is outside (0, 1].
    """
    _check_shapes(draft_tokens, draft_probs, target_probs)
    if not 0 < lenience <= 1:
        raise ValueError(f"lenience must be in (0, 1], got {lenience}")
    batch, k = draft_tokens.shape
    accept_prob = acceptance_probs(draft_tokens, draft_probs, target_probs, lenience)
    # r < ratio (r in [0, 1)) accepts surely at ratio 1 and never at ratio 0.
    uniforms = torch.rand((batch, k), generator=generator, device=draft_tokens.device)
    accepted = uniforms < accept_prob
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    # q at position k is all zeros, so the "residual" there is p_{k+1} itself: the bonus token
    # needs no separate branch.
    q_ext = torch.nn.functional.pad(match_vocab(draft_probs, target_probs.shape[-1]), (0, 0, 0, 1))
    rows = torch.arange(batch, device=draft_tokens.device)
    p_n = target_probs[rows, num_accepted]
    q_n = q_ext[rows, num_accepted]
    next_probs = residual_distribution(p_n, q_n)
    next_token = torch.multinomial(next_probs, 1, generator=generator).squeeze(-1)
    return num_accepted, next_token


def greedy_lenient_step(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                        lenience: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification with lenience, applied before argmax standardisation (paper A.5). LOSSY.

    After argmax every non-argmax token has p = 0, so the sampling rule's lenience can never
    accept it; A.5 instead tests the untempered target distribution p = softmax(logits). The
    paper prints "p(x) ≤ l·max(p)", which at l = 1 would accept everything although the paper
    reports α = 0.75 there: we implement the evident intent p(x) ≥ l·max(p) (paper.md §6.5).

    Args:
        draft_tokens: [B, k] int64, the draft's greedy tokens.
        target_logits: [B, k+1, V] float32, the target's raw logits (untempered, unfiltered);
            row k is used only if all k are kept.
        lenience: l in (0, 1]. x_i is kept iff it is the target's argmax or, for l < 1,
            p_i(x_i) ≥ l·max p_i. At l = 1 only the argmax (lowest id on ties, as
            sampling.adjust) is kept, so the rule is exactly plain greedy verification.
    Returns:
        num_accepted: [B] int64 in [0, k], the length of the kept prefix.
        next_token:   [B] int64, the target's argmax at the first non-kept position (or at
            position k when all are kept). No randomness.
    Raises:
        ValueError: if shapes disagree or lenience is outside (0, 1].
    """
    if (draft_tokens.dim() != 2 or target_logits.dim() != 3
            or target_logits.shape[:2] != (draft_tokens.shape[0], draft_tokens.shape[1] + 1)):
        raise ValueError(f"expected draft_tokens [B, k] and target_logits [B, k+1, V]; got "
                         f"{tuple(draft_tokens.shape)}, {tuple(target_logits.shape)}")
    if not 0 < lenience <= 1:
        raise ValueError(f"lenience must be in (0, 1], got {lenience}")
    batch, k = draft_tokens.shape
    logits = target_logits.float()
    argmax = first_argmax(logits)  # [B, k+1]; the first maximum, as sampling.adjust
    in_vocab = draft_tokens < logits.shape[-1]
    z_x = logits[:, :k].gather(-1, torch.where(in_vocab, draft_tokens, 0).unsqueeze(-1)).squeeze(-1)
    # p(x) / max p = exp(z_x − z_max): compared in log space, no softmax underflow.
    within = (z_x - logits[:, :k].amax(-1)) >= math.log(lenience)
    # At l = 1 a draft tied with the argmax would pass `within`, where plain greedy keeps only
    # the lowest id: the guard makes l = 1 plain greedy token for token.
    accepted = in_vocab & ((draft_tokens == argmax[:, :k]) | (within & (lenience < 1)))
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    next_token = argmax[torch.arange(batch, device=draft_tokens.device), num_accepted]
    return num_accepted, next_token


def drafter_invariant_step(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                           noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the drafts that equal the target's own sample at their position (drafter-invariant
    verification: Daliri, Musco, Suresh 2024, arXiv 2408.07978, on the paper's §2.3 loop).

    The target's token at each position is the exponential race over its adjusted distribution with
    that position's noise (sampling.race): an exact sample of p, and a function of the prefix and
    the noise only. Keeping the drafts up to the first that differs and then emitting the race's
    winner therefore emits exactly what plain decoding with the same noise emits, whatever was
    drafted: the output follows the target's distribution (each position's noise is fresh), and a
    seeded request gives the same tokens with or without speculation. A draft that samples with the
    same noise (DraftModelProposer does) agrees often: at least (1 − TV)/(1 + TV) per token where
    the paper's rule gets 1 − TV (TV = the total variation distance of p and q).

    Args:
        draft_tokens: [B, k] int64.
        target_probs: [B, k+1, V] float32, p; row k is used only if all k are kept.
        noise: [B, k+1, V'] float32 with V' >= V, sampling.race_noise at each of the k+1 positions.
    Returns:
        num_accepted: [B] int64 in [0, k].
        next_token:   [B] int64, the race's winner at the first differing position (or at k).
    Raises:
        ValueError: if shapes disagree (all three are printed).
    """
    if (draft_tokens.dim() != 2 or target_probs.dim() != 3 or noise.dim() != 3
            or target_probs.shape[:2] != (draft_tokens.shape[0], draft_tokens.shape[1] + 1)
            or noise.shape[:2] != target_probs.shape[:2] or noise.shape[2] < target_probs.shape[2]):
        raise ValueError("expected draft_tokens [B, k], target_probs [B, k+1, V], noise [B, k+1, V' >= V]; got "
                         f"{tuple(draft_tokens.shape)}, {tuple(target_probs.shape)}, {tuple(noise.shape)}")
    batch, k = draft_tokens.shape
    winners = race(target_probs, noise)  # [B, k+1]
    num_accepted = (draft_tokens == winners[:, :k]).long().cumprod(dim=1).sum(dim=1)
    return num_accepted, winners[torch.arange(batch, device=draft_tokens.device), num_accepted]


# --- block verification ---------------------------------------------------------------------------
#
# Sun, Mendlovic, Leviathan, Aharoni, Ro, Beirami, Suresh, "Block Verification Accelerates
# Speculative Decoding" (ICLR 2025, arXiv 2403.10444). Derivation (ours), for drafts x_1..x_k with
# Q(x^i) = Π q, P(x^i) = Π p along the block:
#   weights   w_0 = 1,  w_i = min(1, w_{i-1} · p_i(x_i) / q_i(x_i))
#   residual  r_i(y) = max(0, w_i · p_{i+1}(y | x^i) − q_{i+1}(y | x^i)),  R_i = Σ_y r_i(y)
#   stop      h_i = R_i / (R_i + 1 − w_i) for 1 ≤ i < k (0 where both terms vanish), h_k = w_k
#   τ = the largest i in 1..k with η_i < h_i (η i.i.d. uniform), else 0; keep x^τ, then draw
#   from p_{k+1} if τ = k, else from norm(r_τ).
# Backward induction over i gives Pr[τ < i | x^i] = 1 − w_i, since E_{x_{i+1}~q}[1 − w_{i+1}] =
# Σ_y max(0, q − w_i p) = R_i + 1 − w_i. Hence Pr[τ ≥ i, X^i = x^i] = w_i Q(x^i) =: W_i and
# Pr[τ = i, X^i = x^i, Y = y] = max(0, W_i p(y | x^i) − Q(x^i y)). Then by induction on m,
# P(z^m) − W_m(z^m) = Σ_{i<m} max(0, W_i p − Q)(z^{i+1}) · P(z_{i+2..m} | z^{i+1}), which is
# exactly the probability that the emitted block, continued by the target, starts with z^m via
# an earlier stop: the output follows P. Since W_i = min(W_{i-1} p_i, Q(x^i)) ≥ Π min(p_j, q_j),
# E[τ] = Σ_i Σ W_i is never below the token-wise rule's. The proof holds when k is itself chosen
# by the draft side as it drafts (dynamic γ): a stop at i is the case h_i = w_i.


def block_acceptance_probs(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                           target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block rule's stop probabilities h_1..h_k and weights w_0..w_k (Sun et al. 2024, Alg. 2).

    Args:
        draft_tokens: [B, k] int64.
        draft_probs:  [B, k, V_draft] float32, q; zero-padded to V if smaller.
        target_probs: [B, k(+1), V] float32, p; only the first k positions are used.
    Returns:
        stop_probs: [B, k] float64, h_i at column i − 1: τ is the largest i with η_i < h_i.
        weights:    [B, k+1] float64, w_0 = 1 .. w_k in [0, 1]. A drafted id with q = 0 or outside
            the target's vocabulary gets ratio 0: w is 0 from there on (rejected, never NaN).
    """
    batch, k = draft_tokens.shape
    vocab_size = target_probs.shape[-1]
    q = match_vocab(draft_probs, vocab_size)
    in_vocab = draft_tokens < vocab_size
    index = torch.where(in_vocab, draft_tokens, 0).unsqueeze(-1)
    p_x = target_probs[:, :k].gather(-1, index).squeeze(-1).double()
    q_x = q.gather(-1, index).squeeze(-1).double()
    valid = in_vocab & (q_x > 0)
    # float64: p/q for a q near float32's smallest subnormal would overflow float32.
    log_ratio = torch.where(valid, (p_x / torch.where(valid, q_x, 1.0)).log(), -torch.inf)
    # log w_i = min(0, log w_{i-1} + log ratio_i) is S_i − max(0, S_1..S_i) for S = cumsum(log ratio).
    zero = torch.zeros((batch, 1), dtype=torch.float64, device=draft_tokens.device)
    s = torch.cat([zero, log_ratio.cumsum(1)], 1)
    running_max = s.clamp(min=0).cummax(1).values
    weights = torch.where(s == -torch.inf, 0.0, (s - running_max).exp())
    # R_i for i = 1..k-1 (the residual after keeping x^i), summed in float64.
    w_inner = weights[:, 1:k]
    mass = (w_inner.unsqueeze(-1).to(target_probs.dtype) * target_probs[:, 1:k] - q[:, 1:k]).clamp(min=0.0
                                                                                                   ).sum(-1, dtype=torch.float64)
    denominator = mass + 1 - w_inner
    inner = torch.where(denominator > 0, mass / torch.where(denominator > 0, denominator, 1.0), 0.0)
    return torch.cat([inner, weights[:, k:k + 1] if k else weights[:, :0]], 1), weights


def block_step(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
               generator: torch.Generator | None = None, lenience: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep a prefix of the draft chosen by verifying the block jointly (Sun et al. 2024, Alg. 2).

    Exact like speculative_step (the emitted tokens follow p), and keeps at least as many drafts
    in expectation. With one draft, or with one-hot p and q (greedy), it is the token-wise rule.

    Args:
        draft_tokens: [B, k] int64; token i was sampled from draft_probs[:, i].
        draft_probs:  [B, k, V_draft] float32, q; rows sum to 1; zero-padded to V if smaller.
        target_probs: [B, k+1, V] float32, p; row k is used only if all k are kept.
        generator: the request's torch.Generator; draws k uniforms, then one sample (as
            speculative_step, so a seed reproduces).
        lenience: must be 1.0: the block rule has no lossy variant here (kept in the signature
            so that the two rules are interchangeable).
    Returns:
        num_accepted: [B] int64 in [0, k], τ.
        next_token:   [B] int64 from norm(max(0, w_τ p_τ − q_τ)) if τ < k, else from p[:, k].
    Raises:
        ValueError: if shapes disagree (all three are printed) or lenience is not 1.
    """
    _check_shapes(draft_tokens, draft_probs, target_probs)
    if lenience != 1:
        raise ValueError(f"block verification is exact only: lenience must be 1, got {lenience} "
                         "(use the token-wise rule for lossy lenience)")
    batch, k = draft_tokens.shape
    stop_probs, weights = block_acceptance_probs(draft_tokens, draft_probs, target_probs)
    uniforms = torch.rand((batch, k), generator=generator, device=draft_tokens.device)
    # τ = the largest i with η_i < h_i: positions 1..k where it holds, the last of them, or 0.
    hits = (uniforms.double() < stop_probs).long() * torch.arange(1, k + 1, device=draft_tokens.device)
    num_accepted = hits.amax(1) if k else torch.zeros(batch, dtype=torch.long, device=draft_tokens.device)
    # q at position k is all zeros, so w_k p_{k+1} normalized is p_{k+1}: the bonus needs no branch.
    q_ext = torch.nn.functional.pad(match_vocab(draft_probs, target_probs.shape[-1]), (0, 0, 0, 1))
    rows = torch.arange(batch, device=draft_tokens.device)
    w_n = torch.where(num_accepted == k, 1.0, weights[rows, num_accepted])
    next_probs = residual_distribution(target_probs[rows, num_accepted], q_ext[rows, num_accepted], w_n)
    next_token = torch.multinomial(next_probs, 1, generator=generator).squeeze(-1)
    return num_accepted, next_token


# --- token trees ------------------------------------------------------------------------------------
#
# A draft tree (SpecInfer, Miao et al. 2024; Sequoia, Chen et al. 2024): node i holds a token drawn
# from draft_probs[i] (its q, given the path to its parent and the siblings drawn before it), and
# the target scores every node in one call. Verification walks down from the root. At a node,
# with r = p(· | path), the children are tried in the order they were drawn: child c is accepted
# with probability min(1, r(c) / q_c(c)); a rejection replaces r by norm(max(0, r − q_c)). Each
# trial is one step of the paper's rule with target r and draft q_c, so whatever survives the
# trials is distributed as r: the token leaving the node (an accepted child, or a draw from the
# final r) follows p exactly, by induction over the siblings, and then over the depth. This holds
# for i.i.d. siblings (q_c = q), for siblings drawn without replacement (q_c = q renormalized
# without the earlier ones) and for deterministic top-k siblings (one-hot q_c); greedy p and q
# give "follow the child that is the target's argmax". A tree may be shaped by the draft's own
# distributions, but a drawn sibling must never be dropped because of its value.


def tree_step(tree_tokens: torch.Tensor, parents: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
              generator: torch.Generator | None = None) -> tuple[list[int], int, bool]:
    """Keep the longest accepted path of a draft tree, then sample one token (multi-draft rule).

    Args:
        tree_tokens: [N] int64, node i's token.
        parents: N ints, node i's parent (-1 for a child of the root, else an index below i).
            Siblings are tried in index order, which must be the order they were drawn in.
        draft_probs: [N, V_draft] float32, the q node i was drawn from (one-hot if chosen
            deterministically); zero-padded to V if smaller.
        target_probs: [N+1, V] float32: row 0 is p after the committed prefix, row i+1 is p after
            the path to node i.
        generator: the request's torch.Generator (a uniform per tried child, then one sample).
    Returns:
        path: the accepted nodes, root to leaf (node indices).
        next_token: from the last residual if the final node's children were all rejected, else
            (no children) from p after the final node.
        rejected: whether the step ended with a rejection (the next token is a correction).
    Raises:
        ValueError: shapes that disagree, or a parent that is not an earlier node.
    """
    n = tree_tokens.shape[0]
    if tree_tokens.dim() != 1 or len(parents) != n or draft_probs.shape[0] != n or target_probs.shape[0] != n + 1:
        raise ValueError(f"expected tree_tokens [N], N parents, draft_probs [N, V_draft], target_probs [N+1, V]; got "
                         f"{tuple(tree_tokens.shape)}, {len(parents)}, {tuple(draft_probs.shape)}, "
                         f"{tuple(target_probs.shape)}")
    if any(not -1 <= parent < i for i, parent in enumerate(parents)):
        raise ValueError(f"every parent must be -1 or an earlier node, got {list(parents)}")
    vocab_size = target_probs.shape[-1]
    q = match_vocab(draft_probs, vocab_size)
    tokens = tree_tokens.tolist()
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    path, node, rejected = [], -1, False
    while True:
        r = target_probs[node + 1]
        chosen = None
        for child in children.get(node, []):
            token = tokens[child]
            q_x = float(q[child, token]) if token < vocab_size else 0.0
            accept = min(1.0, float(r[token]) / q_x) if q_x > 0 else 0.0
            if float(torch.rand((), generator=generator, device=tree_tokens.device)) < accept:
                chosen = child
                break
            r = residual_distribution(r, q[child])
            rejected = True
        if chosen is None:
            return path, int(torch.multinomial(r, 1, generator=generator)), rejected
        path.append(chosen)
        node, rejected = chosen, False
