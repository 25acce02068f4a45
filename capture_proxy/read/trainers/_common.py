"""What every trainer adapter shares: episodes (a trajectory with its records), the one scalar
reward rule, segments split into prompt and response, and groups numbered as repetitions."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from ...errors import CaptureProxyError
from ...schemas.records import Attachment, StagedCallRecord
from ..cursor import ExportCursor
from ..reader import Store
from ..trajectory import Segment, Trajectory
from ..verified_reads import read_named

__all__ = [
    "Episode",
    "MissingReward",
    "Piece",
    "episodes",
    "pieces",
    "read_episode",
    "repetitions",
    "scalar_reward",
]


class MissingReward(CaptureProxyError, ValueError):
    """A rollout handed to a trainer has no reward (no outcome was sent for it), or lacks the
    named component. Trainers take a number per rollout: grade it first
    (``PUT /admin/rollouts/{id}/outcome``)."""


@dataclass(frozen=True, slots=True)
class Episode:
    """A rollout's `Trajectory` and the staged records it was built from (by call id): the
    records give each segment its finish reason and images."""

    trajectory: Trajectory
    records: Mapping[str, StagedCallRecord]

    @classmethod
    def of(cls, trajectory: Trajectory, records: Iterable[StagedCallRecord]) -> Episode:
        return cls(trajectory, {r.call_id: r for r in records})


def read_episode(
    store: Store,
    rollout_id: str,
    *,
    include_untooled: bool = False,
    include_open: bool = False,
    include_poisoned: bool = False,
    verify: bool = True,
    expected_head: str | None = None,
) -> Episode:
    """One rollout as an `Episode`, read once, with `Store.trajectory`'s keywords, defaults and
    errors (`expected_head`: the seal or outcome answer's ``chain_head`` its driver kept)."""
    records, traj = read_named(
        store,
        rollout_id,
        include_untooled=include_untooled,
        include_open=include_open,
        include_poisoned=include_poisoned,
        verify=verify,
        expected_head=expected_head,
    )
    return Episode.of(traj, records)


def episodes(
    store: Store,
    rollout_ids: Iterable[str] | None = None,
    *,
    include_untooled: bool = False,
    include_open: bool = False,
    include_poisoned: bool = False,
    verify: bool = True,
    since: int | datetime | None = None,
    group: str | Iterable[str] | None = None,
    skipped: dict[str, list[str]] | None = None,
    cursor: ExportCursor | None = None,
    expected_heads: Mapping[str, str] | None = None,
    unverified: dict[str, list[str]] | None = None,
) -> Iterator[Episode]:
    """`Store.iter_trajectories` as episodes, with its keywords, defaults and order (sealed,
    not poisoned, verified; a group's rollouts one after the other; `cursor` takes each sealed
    rollout once); `rollout_ids` keeps those rollouts only (KeyError for one the store does not
    hold). Each rollout is read once, verified with its trajectory (one that does not verify is
    left out, in ``skipped["unverified"]`` and with its problems in `unverified`:
    `capture_proxy.read.integrity`); `expected_heads` anchors the read as it anchors
    `Store.iter_trajectories`."""
    for records, traj in store.iter_read(
        rollouts=rollout_ids,
        include_untooled=include_untooled,
        include_open=include_open,
        include_poisoned=include_poisoned,
        verify=verify,
        since=since,
        group=group,
        skipped=skipped,
        cursor=cursor,
        expected_heads=expected_heads,
        unverified=unverified,
    ):
        yield Episode.of(traj, records)


def scalar_reward(traj: Trajectory, component: str | None = None) -> float:
    """The one number a trainer is given for a rollout.

    A reward sent as one number is that number. A reward sent as an object of named numbers
    (``{"pass": 1.0, "style": 0.5}``) is the **sum** of its components, as NeMo RL's rollout
    totals a multi-reward environment (`total_reward`), unless `component` names the one to
    use. Raises `MissingReward` when the rollout has no reward, or `component` is not one of
    its components.
    """
    parts = traj.reward_components
    if component is not None:
        if parts is None or component not in parts:
            have = sorted(parts) if parts else "no components"
            raise MissingReward(
                f"rollout {traj.rollout_id}: reward component {component!r} not found ({have})"
            )
        return parts[component]
    if traj.reward is not None:
        return traj.reward
    if parts is not None:
        return float(sum(parts.values()))
    raise MissingReward(
        f"rollout {traj.rollout_id} has no reward: send its outcome "
        "(PUT /admin/rollouts/{id}/outcome) before handing it to a trainer"
    )


@dataclass(frozen=True, slots=True)
class Piece:
    """One segment of a trajectory, split as RL trainers take a sequence: `prompt_ids` up to its
    first generated token, then the response (generated tokens, mask 1; tool output and
    template tokens between them, mask 0)."""

    index: int
    last: bool
    segment: Segment
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    #: The finish reason of the segment's last call (``stop``, ``tool_calls``, ``length``, ...).
    finish_reason: str
    #: Why this segment began (`Break.reason`); None for the first.
    break_reason: str | None
    #: The images of the segment's prompt, one per image part in prompt order (an image sent
    #: twice is listed twice): (sha256, media type, bytes).
    images: list[tuple[str, str, bytes]]


def pieces(episode: Episode) -> list[Piece]:
    """The trajectory's segments as `Piece` objects, in order."""
    traj = episode.trajectory
    mask = traj.loss_mask
    generated = mask.tobytes()  # one byte per token: find the first 1 of a segment
    reasons = {b.position: b.reason for b in traj.breaks}
    # A call refers to its images by sha256; the bytes may be stored with another call of the
    # rollout (the one that sent them first).
    stored = {a.sha256: a for r in episode.records.values() for a in r.attachments}
    out: list[Piece] = []
    for i, seg in enumerate(traj.segments):
        found = generated.find(b"\x01", seg.start, seg.end)
        cut = seg.end if found < 0 else found
        records = [episode.records[c] for c in seg.call_ids]
        out.append(
            Piece(
                index=i,
                last=i == len(traj.segments) - 1,
                segment=seg,
                prompt_ids=traj.token_ids[seg.start : cut].tolist(),
                response_ids=traj.token_ids[cut : seg.end].tolist(),
                response_mask=mask[cut : seg.end].tolist(),
                response_logprobs=traj.logprobs[cut : seg.end].tolist(),
                finish_reason=records[-1].finish_reason,
                break_reason=reasons.get(seg.start) if i else None,
                images=_images(records, stored),
            )
        )
    return out


def _images(
    records: Sequence[StagedCallRecord], stored: Mapping[str, Attachment]
) -> list[tuple[str, str, bytes]]:
    # The segment's tokens are its last call's prompt (which holds every earlier call's messages)
    # and completion, so its images are that call's, one per image part in prompt order, an image
    # sent twice listed twice: a VL processor expands one placeholder run per item, and a list
    # with repeats dropped gives fewer items than the prompt has runs (a real Qwen2.5-VL prompt
    # with one image twice, tests/e2e/test_vlm.py).
    out: list[tuple[str, str, bytes]] = []
    for sha in records[-1].attachment_refs() if records else ():
        attachment = stored.get(sha)
        if attachment is not None:
            out.append((sha, attachment.media_type, bytes(attachment.data)))
    return out


def repetitions(trajs: Sequence[Trajectory]) -> list[tuple[str, int]]:
    """Per trajectory, ``(instance id, repetition)``: the group (the rollout id when it has no
    group) and its place among the group's rollouts in `trajs`, from 0."""
    counts: dict[str, int] = {}
    out: list[tuple[str, int]] = []
    for traj in trajs:
        instance = traj.group_id if traj.group_id is not None else traj.rollout_id
        out.append((instance, counts.get(instance, 0)))
        counts[instance] = counts.get(instance, 0) + 1
    return out
