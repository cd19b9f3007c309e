"""Rigs, motion clips and forward kinematics for imitation runs, in pure Python.

A rig is a 2-D planar skeleton: a tree of bones whose root (bone 0) starts at the origin. Every
bone starts where its parent ends and points at its joint angle relative to its parent's
direction (the root's angle is relative to the +x axis). A clip is ``frame_count x joint_count``
joint angles in radians, frame-major, one joint per bone.

This module owns the built-in rig (``stickman``) and clips (``wave``, ``walk``, ``jump``) so that
the trainer (which learns them), the contract (which validates tasks against them) and the CLI
(which draws them) agree on one definition. It needs neither numpy nor torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

from trainwire.v1 import episode_pb2


@dataclass(frozen=True)
class BoneSpec:
    """One bone: its name, parent index (-1 for the root) and length."""

    name: str
    parent: int
    length: float


@dataclass(frozen=True)
class RigSpec:
    """A skeleton: bones in an order where every parent precedes its children."""

    name: str
    bones: tuple[BoneSpec, ...]

    @property
    def bone_count(self) -> int:
        """Number of bones (= joints of a clip for this rig)."""
        return len(self.bones)


@dataclass(frozen=True)
class ClipSpec:
    """A target motion: ``frame_count x joint_count`` angles in radians, frame-major."""

    name: str
    fps: float
    frame_count: int
    joint_count: int
    angles: tuple[float, ...]

    def frame(self, index: int) -> tuple[float, ...]:
        """Returns the joint angles of frame ``index``."""
        start = index * self.joint_count
        return self.angles[start : start + self.joint_count]


_HALF_PI = math.pi / 2

# Rest pose (relative angles) of the stickman: pelvis points up from the hips, the spine and head
# continue it, arms hang slightly away from the body, legs point down from the top of the pelvis.
STICKMAN = RigSpec(
    name="stickman",
    bones=(
        BoneSpec("pelvis", -1, 0.10),
        BoneSpec("spine", 0, 0.50),
        BoneSpec("head", 1, 0.20),
        BoneSpec("left_upper_arm", 1, 0.30),
        BoneSpec("left_forearm", 3, 0.28),
        BoneSpec("right_upper_arm", 1, 0.30),
        BoneSpec("right_forearm", 5, 0.28),
        BoneSpec("left_thigh", 0, 0.45),
        BoneSpec("left_shin", 7, 0.45),
        BoneSpec("right_thigh", 0, 0.45),
        BoneSpec("right_shin", 9, 0.45),
    ),
)
_STICKMAN_REST = (
    _HALF_PI,  # pelvis: up
    0.0,  # spine
    0.0,  # head
    math.pi - 0.35,  # left upper arm: down, slightly out to the left
    0.0,
    -(math.pi - 0.35),  # right upper arm: down, slightly out to the right
    0.0,
    math.pi - 0.12,  # left thigh: down
    0.0,
    -(math.pi - 0.12),  # right thigh: down
    0.0,
)

BUILTIN_RIGS: dict[str, RigSpec] = {STICKMAN.name: STICKMAN}

_FPS = 30.0


def _clip(name: str, seconds: float, pose: Callable[[float], Sequence[float]]) -> ClipSpec:
    """Samples ``pose(phase)`` (phase in [0, 1), periodic) at 30 fps for ``seconds``."""
    frames = round(seconds * _FPS)
    angles: list[float] = []
    for f in range(frames):
        offsets = pose(f / frames)
        angles.extend(rest + off for rest, off in zip(_STICKMAN_REST, offsets, strict=True))
    return ClipSpec(name, _FPS, frames, STICKMAN.bone_count, tuple(angles))


def _wave(phase: float) -> list[float]:
    # The right arm is raised to the side; the forearm waves twice a second; the body sways a bit.
    w = math.sin(2 * math.pi * 4 * phase)
    sway = 0.05 * math.sin(2 * math.pi * phase)
    return [sway, 0.5 * sway, 0.0, 0.1 * w, 0.0, 1.4, 0.9 + 0.5 * w, 0.0, 0.0, 0.0, 0.0]


def _walk(phase: float) -> list[float]:
    # Legs swing in opposition with knees bending on the back swing; arms counter-swing.
    s = math.sin(2 * math.pi * 2 * phase)
    knee_l = -0.6 * max(0.0, math.sin(2 * math.pi * 2 * phase + 1.2))
    knee_r = -0.6 * max(0.0, -math.sin(2 * math.pi * 2 * phase + 1.2))
    return [0.0, 0.05 * s, 0.0, 0.4 * s, 0.3, 0.4 * s, -0.3, -0.45 * s, -knee_l, 0.45 * s, knee_r]


def _jump(phase: float) -> list[float]:
    # Crouch (knees and hips bend), spring (arms swing up, legs straighten), land, recover.
    c = 0.5 - 0.5 * math.cos(2 * math.pi * phase)  # 0 -> 1 -> 0 over the clip
    crouch = math.sin(math.pi * min(1.0, 2 * phase)) ** 2 * (1.0 - c)
    arms = 2.4 * c
    return [
        0.0,
        0.3 * crouch,
        0.0,
        -arms,
        -0.2 * c,
        arms,
        0.2 * c,
        0.7 * crouch,
        -1.3 * crouch,
        -0.7 * crouch,
        1.3 * crouch,
    ]


_CLIP_MAKERS: dict[str, tuple[float, Callable[[float], Sequence[float]]]] = {
    "wave": (2.0, _wave),
    "walk": (2.0, _walk),
    "jump": (3.0, _jump),
}
BUILTIN_CLIP_NAMES: tuple[str, ...] = tuple(_CLIP_MAKERS)


@cache
def builtin_clip(name: str) -> ClipSpec:
    """Returns a built-in clip of the stickman rig.

    Raises:
        KeyError: ``name`` is not one of ``BUILTIN_CLIP_NAMES``.
    """
    seconds, pose = _CLIP_MAKERS[name]
    return _clip(name, seconds, pose)


def rest_pose(rig: RigSpec) -> tuple[float, ...]:
    """Returns the rig's rest pose: the stickman's own, all zeros for a custom rig."""
    if rig == STICKMAN:
        return _STICKMAN_REST
    return tuple(0.0 for _ in rig.bones)


def forward_kinematics(
    rig: RigSpec, frame_angles: Sequence[float]
) -> list[tuple[float, float, float, float]]:
    """Returns every bone's segment ``(x0, y0, x1, y1)`` for one frame of joint angles."""
    segments: list[tuple[float, float, float, float]] = []
    heading: list[float] = []
    for bone, angle in zip(rig.bones, frame_angles, strict=True):
        if bone.parent < 0:
            x0 = y0 = 0.0
            direction = angle
        else:
            x0, y0 = segments[bone.parent][2], segments[bone.parent][3]
            direction = heading[bone.parent] + angle
        heading.append(direction)
        segments.append(
            (x0, y0, x0 + bone.length * math.cos(direction), y0 + bone.length * math.sin(direction))
        )
    return segments


def rig_height(rig: RigSpec, frame_angles: Sequence[float]) -> float:
    """Height of the bounding box of the rig's bones (all segment end points) in one pose."""
    ys = [y for seg in forward_kinematics(rig, frame_angles) for y in (seg[1], seg[3])]
    return max(ys) - min(ys)


def rig_from_proto(rig: episode_pb2.Rig) -> RigSpec:
    """Converts a ``Rig`` message (assumed valid, see ``trainwire.contract``)."""
    return RigSpec(
        rig.name or "custom",
        tuple(BoneSpec(b.name or f"bone{i}", b.parent, b.length) for i, b in enumerate(rig.bones)),
    )


def rig_to_proto(rig: RigSpec) -> episode_pb2.Rig:
    """Converts a rig to its ``Rig`` message."""
    return episode_pb2.Rig(
        name=rig.name,
        bones=[episode_pb2.Bone(name=b.name, parent=b.parent, length=b.length) for b in rig.bones],
    )


def clip_from_proto(clip: episode_pb2.Clip) -> ClipSpec:
    """Converts a ``Clip`` message (assumed valid, see ``trainwire.contract``)."""
    return ClipSpec(
        clip.name or "custom",
        clip.fps,
        clip.frame_count,
        clip.joint_count,
        tuple(float(a) for a in clip.angles),
    )


def clip_to_proto(clip: ClipSpec) -> episode_pb2.Clip:
    """Converts a clip to its ``Clip`` message."""
    return episode_pb2.Clip(
        name=clip.name,
        fps=clip.fps,
        frame_count=clip.frame_count,
        joint_count=clip.joint_count,
        angles=clip.angles,
    )


def rig_from_task(task: episode_pb2.ImitationTask) -> RigSpec:
    """The task's rig: the named built-in (default ``stickman``) or its custom rig.

    Raises:
        KeyError: an unknown built-in rig name.
    """
    if task.WhichOneof("rig_source") == "rig":
        return rig_from_proto(task.rig)
    return BUILTIN_RIGS[task.rig_name or STICKMAN.name]


def clip_from_task(task: episode_pb2.ImitationTask) -> ClipSpec:
    """The task's clip: the named built-in or its custom clip.

    Raises:
        KeyError: an unknown built-in clip name (or none given).
    """
    if task.WhichOneof("clip_source") == "clip":
        return clip_from_proto(task.clip)
    return builtin_clip(task.clip_name)
