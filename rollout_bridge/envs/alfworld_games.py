"""ALFWorld games generated locally from the `alfworld` package's own data.

ALFWorld's released games (`alfworld-download`) cannot be fetched here, but the package
ships what defines them: the PDDL domain (`alfworld/data/alfred.pddl`), the text grammar
(`alfred.twl2`, whose "UNKNOWN GOAL" is the task text), 120 floor plans
(`alfworld/gen/layouts/FloorPlan<N>-objects.json`: object types in the scene;
`-openable.json`: receptacle id -> agent pose [x, z, rotation, horizon] to interact with
it), the six task types' goals and text templates (`alfworld/gen/goal_library.py`) and
which receptacle may hold which object (`alfworld/gen/constants.py`).

One game = one seed. `generate_game(seed, task_type)` draws, with `random.Random(seed)`:
a floor plan on which the task is possible, a target (object type, receptacle type, lamp
for the light task), 1 (2 for pick_two) target instances and up to `max_distractors`
other objects, each put in a receptacle whose type may contain it (never one of the goal
receptacle's type, so no game starts won), openable receptacles closed, ids in ALFRED's
mangled form (`Apple|+00.30|+00.90|-01.20` -> `Apple_bar__plus_00_dot_30_...`). The PDDL
problem is written, the planner (fast-downward, `textworld[pddl]`) solves it under
ALFWorld's wrappers, the walkthrough is replayed to a win and stored in the game file. A
draw the planner cannot solve is re-drawn from the same rng (bounded, then an error).

ALFRED's task sampler: with `alfred_filter` (the default) a draw that ALFRED's sampler
would not make (`alfred_exclusions`: the room types a task type is sampled in, and
`get_filter_crit`'s object and receptacle criteria, e.g. no heat task whose apple starts
in the microwave or whose goal is the microwave) is re-drawn from the same rng, and the
criteria of the re-drawn draws are recorded with the game. `floor_plans` restricts the
draw to ALFRED's training or test floor plans (`split_floor_plans`: alfworld's
`TRAIN_SCENE_NUMBERS` / `TEST_SCENE_NUMBERS`).

Each game is a folder in ALFWorld's layout, `<task_type>-<Obj>-None-<Recep>-<scene>/
trial_s<seed>/` with `game.tw-pddl` (keys `pddl_domain`, `grammar`, `pddl_problem`,
`solvable`, `walkthrough`) and `traj_data.json` (`task_type`, `pddl_params`: what
ALFWorld's hand-coded expert reads), so the env plays generated and downloaded games alike.
How these games differ from the released ones: docs/ALFWORLD.md.

A *set* is `num_games` games, game i with seed `base_seed + i` and task type
`task_types[i % len(task_types)]`, in `data_dir/<spec.folder_name>/`, complete once its
`manifest.json` is written (last, atomically); a complete set is reused. Games are made
by `workers` processes with a progress callback.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import random
import re
from pathlib import Path
from typing import Callable, Sequence

from rollout_bridge.envs.process_pool import worker_pool
from rollout_bridge.envs.alfworld_env import (GAME_FILE, GAME_KEYS, AlfredPddlGame,  # noqa: F401 (re-exported)
                                            GameFileError, read_game_file)
from rollout_bridge.atomic_files import write_json_atomic

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
# The receptacle a state-change task needs (domain actions CleanObject / HeatObject / CoolObject)
# and the VAL_ACTION_OBJECTS class its object must be in.
STATE_CHANGE = {
    "pick_clean_then_place_in_recep": ("SinkBasin", "Cleanable"),
    "pick_heat_then_place_in_recep": ("Microwave", "Heatable"),
    "pick_cool_then_place_in_recep": ("Fridge", "Coolable"),
}
LAMP_TYPES = ("DeskLamp", "FloorLamp")
# THOR puts lamps on furniture; the light goal needs the lamp `inReceptacle` of something.
LAMP_RECEPTACLES = ("SideTable", "Desk", "Dresser", "DiningTable", "CoffeeTable", "TVStand",
                    "Shelf", "CounterTop")
GRID_STEP_M = 0.25            # THOR's navigation grid (constants.AGENT_STEP_SIZE)
ROTATION_STEP_DEG = 90        # poses turn in quarter turns (constants.AGENT_ROTATE_ADJ)
OBJECT_OFFSET_M = 0.30        # generated object positions: receptacle position +- this
MAX_DRAWS_PER_GAME = 20       # planner-unsolvable draws re-drawn before giving up
MAX_EXCLUDED_DRAWS = 500      # draws ALFRED's sampler would not make, re-drawn before giving up
FLOOR_PLAN_SPLITS = ("all", "train", "test")
MANIFEST = "manifest.json"
TRAJ_DATA = "traj_data.json"
GOAL_PLACEHOLDER = "UNKNOWN GOAL"


# --------------------------------------------------------------------------- package data

@functools.lru_cache(maxsize=None)
def package_data() -> dict:
    """The alfworld package's domain, grammar and layout folder (read once per process)."""
    import alfworld

    root = Path(alfworld.__file__).parent
    return {
        "domain": (root / "data" / "alfred.pddl").read_text(),
        "grammar": (root / "data" / "alfred.twl2").read_text(),
        "layouts": root / "gen" / "layouts",
    }


@functools.lru_cache(maxsize=None)
def scene_numbers() -> tuple[int, ...]:
    """Floor plans that ship both an -objects.json and an -openable.json file."""
    layouts = package_data()["layouts"]
    found = []
    for path in layouts.glob("FloorPlan*-objects.json"):
        number = int(re.fullmatch(r"FloorPlan(\d+)-objects\.json", path.name).group(1))
        if (layouts / f"FloorPlan{number}-openable.json").exists():
            found.append(number)
    return tuple(sorted(found))


def split_floor_plans(split: str) -> tuple[int, ...]:
    """The floor plans (with layout files) of ALFRED's `split`, as `alfworld.gen.constants`
    lists them: "train" = `TRAIN_SCENE_NUMBERS` (FloorPlan 7-30, 207-230, 307-330, 407-430:
    the plans ALFRED samples training tasks on), "test" = `TEST_SCENE_NUMBERS` (1-6, 201-206,
    301-306, 401-406: never seen in training), "all" = every plan."""
    from alfworld.gen import constants

    if split not in FLOOR_PLAN_SPLITS:
        raise ValueError(f"floor_plans must be one of {FLOOR_PLAN_SPLITS}, got {split!r}")
    if split == "all":
        return scene_numbers()
    listed = set(constants.TRAIN_SCENE_NUMBERS if split == "train" else constants.TEST_SCENE_NUMBERS)
    return tuple(n for n in scene_numbers() if n in listed)


def room_type(number: int) -> str:
    """Kitchen, LivingRoom, Bedroom or Bathroom (`constants.SCENE_TYPE`)."""
    from alfworld.gen import constants

    for room, numbers in constants.SCENE_TYPE.items():
        if number in numbers:
            return room
    raise ValueError(f"FloorPlan{number} has no room type in alfworld.gen.constants.SCENE_TYPE")


@dataclasses.dataclass(frozen=True)
class Scene:
    """One floor plan: receptacles (id -> pose [x m, z m, rotation deg, horizon deg]) and
    the pickupable object / lamp types THOR places in it."""

    number: int
    receptacles: dict
    object_types: tuple[str, ...]
    lamp_types: tuple[str, ...]

    @staticmethod
    def receptacle_type(receptacle_id: str) -> str:
        """"Cabinet|x|y|z" -> Cabinet; "Sink|x|y|z|SinkBasin" -> SinkBasin."""
        parts = receptacle_id.split("|")
        return parts[-1] if len(parts) == 5 else parts[0]

    def receptacles_of(self, rtype: str) -> list[str]:
        return [r for r in self.receptacles if self.receptacle_type(r) == rtype]

    @property
    def receptacle_types(self) -> set[str]:
        return {self.receptacle_type(r) for r in self.receptacles}


@functools.lru_cache(maxsize=None)
def load_scene(number: int) -> Scene:
    """Read FloorPlan<number>'s layout files; keep receptacles of ALFRED's static types."""
    from alfworld.gen import constants

    layouts = package_data()["layouts"]
    with open(layouts / f"FloorPlan{number}-objects.json") as f:
        types = json.load(f)
    with open(layouts / f"FloorPlan{number}-openable.json") as f:
        poses = json.load(f)
    static = constants.RECEPTACLES - constants.MOVABLE_RECEPTACLES_SET
    receptacles = {}
    for rid, pose in sorted(poses.items()):
        if Scene.receptacle_type(rid) in static:
            receptacles[rid] = tuple(pose)
    pickupable = set().union(*constants.VAL_RECEPTACLE_OBJECTS.values())
    objects = tuple(sorted(t for t in set(types) if t in pickupable and "Sliced" not in t))
    lamps = tuple(sorted(t for t in set(types) if t in LAMP_TYPES))
    return Scene(number, receptacles, objects, lamps)


def can_contain(rtype: str, otype: str) -> bool:
    from alfworld.gen import constants

    return otype in constants.VAL_RECEPTACLE_OBJECTS.get(rtype, ())


def has_action_class(otype: str, action_class: str) -> bool:
    from alfworld.gen import constants

    return otype in constants.VAL_ACTION_OBJECTS[action_class]


# --------------------------------------------------------------------------- task draw

@dataclasses.dataclass(frozen=True)
class TaskDraw:
    """What a game asks: ALFRED's pddl_params (object_target, parent_target,
    toggle_target; mrecep_target and slicing are not among the six types)."""

    task_type: str
    scene: int
    object_target: str
    parent_target: str      # "" for look_at_obj_in_light
    toggle_target: str      # "" unless look_at_obj_in_light

    def pddl_params(self) -> dict:
        return {"object_target": self.object_target, "parent_target": self.parent_target,
                "toggle_target": self.toggle_target, "mrecep_target": "",
                "object_sliced": False}

    def folder_name(self) -> str:
        recep = self.parent_target or self.toggle_target
        return f"{self.task_type}-{self.object_target}-None-{recep}-{self.scene}"


def _placeable(scene: Scene, otype: str, avoid: str) -> bool:
    return any(can_contain(t, otype) for t in scene.receptacle_types if t != avoid)


def task_candidates(scene: Scene, task_type: str) -> list[TaskDraw]:
    """Every (object, receptacle / lamp) target the scene allows for `task_type`, sorted."""
    if task_type not in TASK_TYPES:
        raise ValueError(f"task_type must be one of {TASK_TYPES}, got {task_type!r}")
    found = []
    if task_type == "look_at_obj_in_light":
        holders = [t for t in LAMP_RECEPTACLES if t in scene.receptacle_types]
        if holders:
            for lamp in scene.lamp_types:
                for otype in scene.object_types:
                    if _placeable(scene, otype, avoid=""):
                        found.append(TaskDraw(task_type, scene.number, otype, "", lamp))
        return found
    needed = STATE_CHANGE.get(task_type)
    if needed is not None and needed[0] not in scene.receptacle_types:
        return found
    for otype in scene.object_types:
        if needed is not None and not has_action_class(otype, needed[1]):
            continue
        for rtype in sorted(scene.receptacle_types):
            if can_contain(rtype, otype) and _placeable(scene, otype, avoid=rtype):
                found.append(TaskDraw(task_type, scene.number, otype, rtype, ""))
    return found


def draw_task(rng: random.Random, task_type: str, exclude: frozenset = frozenset(),
              floor_plans: str = "all") -> TaskDraw:
    """A floor plan of `floor_plans` (`split_floor_plans`) where `task_type` is possible,
    then one of its targets, uniformly; targets whose `folder_name()` is in `exclude`
    (tasks of another set) are never drawn."""
    scenes = list(split_floor_plans(floor_plans))
    rng.shuffle(scenes)
    for number in scenes:
        candidates = [c for c in task_candidates(load_scene(number), task_type)
                      if c.folder_name() not in exclude]
        if candidates:
            return rng.choice(candidates)
    raise RuntimeError(f"no floor plan allows task type {task_type!r}")


# --------------------------------------------------------------------------- ALFRED's sampler

@dataclasses.dataclass(frozen=True)
class Exclusion:
    """One reason ALFRED's task sampler would not make a task: `criterion` (one of
    `ALFRED_CRITERIA`) and a sentence naming the objects involved."""

    criterion: str
    reason: str


ALFRED_CRITERIA = ("room_type", "object_action", "object_in_appliance", "goal_is_appliance",
                   "fewer_than_two", "goal_holds_object_type", "toggle_target")


def alfred_exclusions(draw: TaskDraw, objects: Sequence[tuple[str, str]]) -> tuple[Exclusion, ...]:
    """Why ALFRED's task sampler would not sample `draw` from this start state; empty when
    it would. `objects`: (object type, receptacle type) of every object at the start.

    The criteria are ALFRED's (`alfworld.gen.constants.GOALS_VALID` and
    `TaskGameState.get_filter_crit` in `alfworld/gen/game_states/task_game_state.py`),
    restated here for a start state given as types:
    - room_type: the floor plan's room (`room_type`) is one the task type is sampled in
      (light: living rooms, bedrooms; clean: kitchens, bathrooms; heat, cool: kitchens);
    - object_action (clean / heat / cool): the target is Cleanable / Heatable / Coolable;
    - object_in_appliance (clean / heat / cool): no object of the target's type starts in a
      receptacle of the task's appliance type (SinkBasin / Microwave / Fridge);
    - goal_is_appliance (clean / heat / cool): the goal receptacle is not of that type;
    - fewer_than_two (pick two): at least two objects of the target's type;
    - goal_holds_object_type (pick two): no receptacle of the goal's type holds an object
      whose type name contains the target's (ALFRED tests the object id by substring, so a
      Pencil counts for a Pen);
    - toggle_target (light): the lamp is a Toggleable type and present (lamps start off).
    """
    from alfworld.gen import constants

    found = []
    kind, target = draw.task_type, draw.object_target
    room = room_type(draw.scene)
    if room not in constants.GOALS_VALID[kind]:
        found.append(Exclusion("room_type", f"{kind} is not sampled in a {room} "
                                            f"(FloorPlan{draw.scene})"))
    if kind in STATE_CHANGE:
        appliance, action_class = STATE_CHANGE[kind]
        if not has_action_class(target, action_class):
            found.append(Exclusion("object_action", f"{target} is not {action_class}"))
        if any(otype == target and rtype == appliance for otype, rtype in objects):
            found.append(Exclusion("object_in_appliance",
                                   f"a {target} starts in the {appliance}"))
        if draw.parent_target == appliance:
            found.append(Exclusion("goal_is_appliance", f"the goal receptacle is the {appliance}"))
    if kind == "pick_two_obj_and_place":
        if sum(otype == target for otype, _ in objects) < 2:
            found.append(Exclusion("fewer_than_two", f"fewer than two {target}s"))
        holding = sorted({otype for otype, rtype in objects
                          if rtype == draw.parent_target and target in otype})
        if holding:
            found.append(Exclusion("goal_holds_object_type",
                                   f"a {draw.parent_target} already holds a {holding[0]}"))
    if kind == "look_at_obj_in_light":
        lamp = draw.toggle_target
        if (lamp not in constants.VAL_ACTION_OBJECTS["Toggleable"]
                or not any(otype == lamp for otype, _ in objects)):
            found.append(Exclusion("toggle_target", f"no toggleable {lamp} in the scene"))
    return tuple(found)


def restrict_scene(rng: random.Random, scene: Scene, draw: TaskDraw,
                   max_receptacles: int | None) -> Scene:
    """The scene with at most `max_receptacles` receptacles (None: all of the floor plan):
    one of the goal's type, the state change's (sink, microwave, fridge), a lamp holder,
    one other receptacle that can hold the target, then random others."""
    if max_receptacles is None or len(scene.receptacles) <= max_receptacles:
        return scene
    ids = sorted(scene.receptacles)
    needed_types = [draw.parent_target, STATE_CHANGE.get(draw.task_type, ("",))[0]]
    keep: list[str] = []

    def keep_one(pool: list[str]) -> None:
        pool = [r for r in pool if r not in keep]
        if pool:
            keep.append(rng.choice(pool))
    for rtype in needed_types:
        if rtype:
            keep_one([r for r in ids if scene.receptacle_type(r) == rtype])
    if draw.toggle_target:
        keep_one([r for r in ids if scene.receptacle_type(r) in LAMP_RECEPTACLES])
    keep_one([r for r in ids if scene.receptacle_type(r) != draw.parent_target
              and can_contain(scene.receptacle_type(r), draw.object_target)])
    others = [r for r in ids if r not in keep]
    keep += rng.sample(others, max(0, max_receptacles - len(keep)))
    return Scene(scene.number, {r: scene.receptacles[r] for r in sorted(keep)},
                 scene.object_types, scene.lamp_types)


def task_description(rng: random.Random, draw: TaskDraw) -> str:
    """ALFWorld's templated goal text (goal_library templates, lower-cased names, as
    `alfworld.agents.utils.misc.get_templated_task_desc`, with our rng)."""
    from alfworld.gen import goal_library

    template = rng.choice(goal_library.gdict[draw.task_type]["templates"])
    return template.format(obj=draw.object_target.lower(), recep=draw.parent_target.lower(),
                           toggle=draw.toggle_target.lower(), mrecep="")


# --------------------------------------------------------------------------- PDDL problem

def mangle(name: str) -> str:
    """ALFRED's PDDL-safe id (planned_game_state.fix_pddl_str_chars without '#')."""
    for char, word in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"),
                       (",", "_comma_")):
        name = name.replace(char, word)
    return name


def location_id(pose: Sequence[float]) -> str:
    """`loc|x|z|r|h`: grid cell (x, z in GRID_STEP_M steps), quarter turns, horizon."""
    x, z, rotation, horizon = pose
    return mangle(f"loc|{round(x / GRID_STEP_M)}|{round(z / GRID_STEP_M)}|"
                  f"{round(rotation / ROTATION_STEP_DEG) % 4}|{round(horizon)}")


def grid_distance(a: str, b: str) -> int:
    """Stand-in for ALFRED's path length + 1: Manhattan grid distance + turns + 1."""
    def parts(loc):
        return [int(v) for v in loc.replace("_minus_", "-").split("_bar_")[1:]]
    (xa, za, ra, _), (xb, zb, rb, _) = parts(a), parts(b)
    turns = min((ra - rb) % 4, (rb - ra) % 4)
    return abs(xa - xb) + abs(za - zb) + turns + 1


def _receptacle_position(receptacle_id: str) -> tuple[float, float, float]:
    x, y, z = (float(v) for v in receptacle_id.split("|")[1:4])
    return x, y, z


def _object_id(rng: random.Random, otype: str, receptacle_id: str, taken: set) -> str:
    """`Type|+x.xx|+y.yy|+z.zz` near the receptacle; unique within the game."""
    x, y, z = _receptacle_position(receptacle_id)
    while True:
        dx, dz = (rng.uniform(-OBJECT_OFFSET_M, OBJECT_OFFSET_M) for _ in range(2))
        oid = f"{otype}|{x + dx:+06.2f}|{y + 0.05:+06.2f}|{z + dz:+06.2f}"
        if oid not in taken:
            taken.add(oid)
            return oid


@dataclasses.dataclass
class Placement:
    """Objects of one game: object id -> (type, receptacle id)."""

    objects: dict = dataclasses.field(default_factory=dict)

    def put(self, rng: random.Random, otype: str, receptacle_id: str) -> None:
        oid = _object_id(rng, otype, receptacle_id, set(self.objects))
        self.objects[oid] = (otype, receptacle_id)

    def types(self) -> list[tuple[str, str]]:
        """(object type, receptacle type) of every object, in id order."""
        return [(otype, Scene.receptacle_type(rid)) for _, (otype, rid)
                in sorted(self.objects.items())]


def place_objects(rng: random.Random, scene: Scene, draw: TaskDraw,
                  max_distractors: int) -> Placement:
    """Targets (2 for pick_two), the lamp, then 0..max_distractors other scene objects,
    each in a random receptacle allowed to contain it and not of the goal's type."""
    placement = Placement()

    def put_somewhere(otype: str, holders: Sequence[str] | None = None) -> None:
        if holders is None:
            holders = [r for r in scene.receptacles
                       if scene.receptacle_type(r) != draw.parent_target
                       and can_contain(scene.receptacle_type(r), otype)]
        placement.put(rng, otype, rng.choice(sorted(holders)))

    copies = 2 if draw.task_type == "pick_two_obj_and_place" else 1
    for _ in range(copies):
        put_somewhere(draw.object_target)
    if draw.toggle_target:
        put_somewhere(draw.toggle_target, [r for r in scene.receptacles
                                           if scene.receptacle_type(r) in LAMP_RECEPTACLES])
    others = [t for t in scene.object_types if t != draw.object_target
              and _placeable(scene, t, avoid=draw.parent_target)]
    for otype in rng.sample(others, min(len(others), rng.randint(0, max_distractors))):
        put_somewhere(otype)
    return placement


def goal_pddl(draw: TaskDraw) -> str:
    """The task type's goal from alfworld's goal_library ('#' -> '-' as ALFRED does);
    it ends with the ')' that closes the problem."""
    from alfworld.gen import goal_library

    text = goal_library.gdict[draw.task_type]["pddl"].format(
        obj=draw.object_target, recep=draw.parent_target, toggle=draw.toggle_target)
    return text.replace("#", "-")


def problem_pddl(name: str, scene: Scene, draw: TaskDraw, placement: Placement,
                 agent_pose: Sequence[float]) -> str:
    """The full PDDL problem: every receptacle of the floor plan, the placed objects, the
    agent's start, type / capability facts, pairwise distances, the goal."""
    from alfworld.gen import constants

    receptacles = sorted(scene.receptacles)
    rtypes = sorted(scene.receptacle_types)
    otypes = sorted({t for t, _ in placement.objects.values()})
    agent_loc = location_id(agent_pose)
    locations = sorted({location_id(p) for p in scene.receptacles.values()} | {agent_loc})
    declare = ["agent1 - agent"]
    declare += [f"{t}Type - otype" for t in otypes]
    declare += [f"{t}Type - rtype" for t in rtypes]
    declare += [f"{mangle(o)} - object" for o in sorted(placement.objects)]
    declare += [f"{mangle(r)} - receptacle" for r in receptacles]
    declare += [f"{loc} - location" for loc in locations]
    facts = [f"(atLocation agent1 {agent_loc})"]
    for r in receptacles:
        facts.append(f"(receptacleType {mangle(r)} {scene.receptacle_type(r)}Type)")
        facts.append(f"(receptacleAtLocation {mangle(r)} {location_id(scene.receptacles[r])})")
        if scene.receptacle_type(r) in constants.OPENABLE_CLASS_SET:
            facts.append(f"(openable {mangle(r)})")
    capability = (("cleanable", "Cleanable"), ("heatable", "Heatable"),
                  ("coolable", "Coolable"), ("sliceable", "Sliceable"))
    for oid, (otype, rid) in sorted(placement.objects.items()):
        obj = mangle(oid)
        facts.append(f"(objectType {obj} {otype}Type)")
        facts.append(f"(inReceptacle {obj} {mangle(rid)})")
        facts.append(f"(objectAtLocation {obj} {location_id(scene.receptacles[rid])})")
        if otype in LAMP_TYPES:
            facts.append(f"(toggleable {obj})")
            continue
        facts.append(f"(pickupable {obj})")
        facts += [f"({pred} {obj})" for pred, cls in capability if has_action_class(otype, cls)]
    facts += [f"(canContain {r}Type {o}Type)" for r in rtypes for o in otypes if can_contain(r, o)]
    facts += [f"(= (distance {a} {b}) {grid_distance(a, b)})"
              for a in locations for b in locations if a != b]
    return (f"(define (problem {name})\n(:domain alfred)\n(:objects\n" + "\n".join(declare)
            + "\n)\n(:init\n" + "\n".join(facts) + "\n)\n" + goal_pddl(draw).strip() + "\n")


def agent_start(rng: random.Random, scene: Scene) -> tuple:
    """A start pose one grid step beside a random receptacle's pose (not at any receptacle),
    facing a random quarter turn."""
    poses = [scene.receptacles[r] for r in sorted(scene.receptacles)]
    taken = {location_id(p) for p in poses}
    while True:
        x, z, _, horizon = rng.choice(poses)
        pose = (x + GRID_STEP_M * rng.choice((-1, 1)), z + GRID_STEP_M * rng.choice((-1, 1)),
                ROTATION_STEP_DEG * rng.randrange(4), horizon)
        if location_id(pose) not in taken:
            return pose


# --------------------------------------------------------------------------- game files


def game_start_state(path: str | os.PathLike) -> tuple[TaskDraw, list[tuple[str, str]]]:
    """What `alfred_exclusions` reads, from a game folder's files: the task (traj_data.json's
    `task_type`, `pddl_params` and floor plan) and (object type, receptacle type) of every
    object the PDDL problem puts in a receptacle at the start."""
    folder = Path(path).parent
    with open(folder / TRAJ_DATA) as f:
        traj = json.load(f)
    params = traj["pddl_params"]
    scene = int(re.fullmatch(r"FloorPlan(\d+)", traj["scene"]["floor_plan"]).group(1))
    draw = TaskDraw(traj["task_type"], scene, params["object_target"],
                    params["parent_target"], params["toggle_target"])
    init = read_game_file(path)["pddl_problem"].split("(:goal")[0]

    def facts(predicate: str) -> dict:
        return dict(re.findall(rf"\({predicate} (\S+) (\S+)\)", init))
    otype, rtype = facts("objectType"), facts("receptacleType")
    objects = sorted((otype[o].removesuffix("Type"), rtype[r].removesuffix("Type"))
                     for o, r in facts("inReceptacle").items())
    return draw, objects


def planner_walkthrough(game: dict) -> list[str]:
    """Solve `game` (a game.tw-pddl dict) with the planner under ALFWorld's demangler, then
    replay the plan; return it if it wins, else raise RuntimeError."""
    player = _generation_player()
    player.set_planning(True)
    state = player.load(game)
    plan = list(state.get("policy_commands") or [])
    if not plan:
        raise RuntimeError("the planner found no plan")
    player.set_planning(False)
    for command in plan:
        state = player.step(command)
    if not state["won"]:
        raise RuntimeError(f"the planner's plan does not win: {plan}")
    return plan


@functools.lru_cache(maxsize=None)
def _generation_player():
    """One planner player per process (each loads a fast-downward library copy)."""
    return AlfredPddlGame(plan=True)


@dataclasses.dataclass(frozen=True)
class GeneratedGame:
    """One generated game before it is written: where, what, and the two files' contents."""

    relative_dir: str
    game: dict
    traj_data: dict

    def record(self) -> dict:
        generated = self.traj_data["generated"]
        record = {"dir": self.relative_dir, "seed": generated["seed"],
                  "task_type": self.traj_data["task_type"], "task": generated["task"],
                  "walkthrough": self.game["walkthrough"]}
        if "excluded" in generated:
            record["excluded"] = generated["excluded"]
        return record


def generate_game(seed: int, task_type: str, max_distractors: int = 6,
                  max_receptacles: int | None = None,
                  exclude: frozenset = frozenset(), floor_plans: str = "all",
                  alfred_filter: bool = True) -> GeneratedGame:
    """The game of `seed` for `task_type` (deterministic), on a floor plan of `floor_plans`
    (`split_floor_plans`), solved by the planner; its task (`TaskDraw.folder_name()`) is not
    in `exclude`. With `alfred_filter`, a draw ALFRED's sampler would not make
    (`alfred_exclusions`) is re-drawn from the same rng; the criteria of the draws
    re-drawn are counted in traj_data["generated"]["excluded"]."""
    if max_receptacles is not None and max_receptacles < 4:
        raise ValueError(f"max_receptacles must be None or >= 4, got {max_receptacles}")
    if task_type not in TASK_TYPES:
        raise ValueError(f"task_type must be one of {TASK_TYPES}, got {task_type!r}")
    if max_distractors < 0:
        raise ValueError(f"max_distractors must be >= 0, got {max_distractors}")
    split_floor_plans(floor_plans)
    rng = random.Random(seed)
    data = package_data()
    errors: list[str] = []
    excluded: dict[str, int] = {}
    rejected = 0
    attempt = 0
    while attempt < MAX_DRAWS_PER_GAME:
        draw = draw_task(rng, task_type, exclude, floor_plans)
        scene = restrict_scene(rng, load_scene(draw.scene), draw, max_receptacles)
        placement = place_objects(rng, scene, draw, max_distractors)
        if alfred_filter:
            reasons = alfred_exclusions(draw, placement.types())
            if reasons:
                rejected += 1
                for criterion in sorted({r.criterion for r in reasons}):
                    excluded[criterion] = excluded.get(criterion, 0) + 1
                if rejected >= MAX_EXCLUDED_DRAWS:
                    raise RuntimeError(f"seed {seed} ({task_type}): {rejected} draws excluded "
                                       f"by ALFRED's criteria: {excluded}")
                continue
        task = task_description(rng, draw)
        problem = problem_pddl(f"plan_generated_s{seed}", scene, draw, placement,
                               agent_start(rng, scene))
        game = {"pddl_domain": data["domain"],
                "grammar": data["grammar"].replace(GOAL_PLACEHOLDER, task),
                "pddl_problem": problem, "solvable": True}
        try:
            game["walkthrough"] = planner_walkthrough(game)
        except RuntimeError as exc:
            errors.append(f"draw {attempt}: {exc}")
            attempt += 1
            continue
        generated = {"seed": seed, "task": task, "attempt": attempt,
                     "by": "rollout_bridge.envs.alfworld_games"}
        if alfred_filter:
            generated["excluded"] = {"draws": rejected, **excluded}
        traj_data = {"task_type": task_type, "pddl_params": draw.pddl_params(),
                     "scene": {"floor_plan": f"FloorPlan{draw.scene}"},
                     "generated": generated}
        return GeneratedGame(f"{draw.folder_name()}/trial_s{seed:06d}", game, traj_data)
    raise RuntimeError(f"seed {seed} ({task_type}): no solvable draw in {MAX_DRAWS_PER_GAME} "
                       f"tries: {errors[-3:]}")


def write_game(generated: GeneratedGame, set_folder: Path) -> Path:
    """Write game.tw-pddl and traj_data.json under `set_folder`; return the game path."""
    folder = set_folder / generated.relative_dir
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / TRAJ_DATA, "w") as f:
        json.dump(generated.traj_data, f, indent=1)
    with open(folder / GAME_FILE, "w") as f:
        json.dump(generated.game, f)
    return folder / GAME_FILE


# --------------------------------------------------------------------------- game sets

@dataclasses.dataclass(frozen=True)
class AlfworldSetSpec:
    """`num_games` games, game i: seed `base_seed + i`, type `task_types[i % len]`."""

    name: str
    num_games: int
    base_seed: int
    task_types: tuple[str, ...] = TASK_TYPES
    max_distractors: int = 6
    max_receptacles: int | None = None     # None: every receptacle of the floor plan
    exclude_tasks: tuple[str, ...] = ()    # task folder names of other sets, never drawn
    floor_plans: str = "all"               # split_floor_plans: "all", "train" or "test"
    alfred_filter: bool = True             # only draws ALFRED's sampler would make

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9_\-]+", self.name):
            raise ValueError(f"name must be [A-Za-z0-9_-]+, got {self.name!r}")
        if self.num_games < 1:
            raise ValueError(f"num_games must be >= 1, got {self.num_games}")
        if self.base_seed < 0:
            raise ValueError(f"base_seed must be >= 0, got {self.base_seed}")
        object.__setattr__(self, "task_types", tuple(self.task_types))
        unknown = [t for t in self.task_types if t not in TASK_TYPES]
        if not self.task_types or unknown:
            raise ValueError(f"task_types must be a non-empty subset of {TASK_TYPES}, "
                             f"got {self.task_types!r}")
        if self.max_distractors < 0:
            raise ValueError(f"max_distractors must be >= 0, got {self.max_distractors}")
        if self.max_receptacles is not None and self.max_receptacles < 4:
            raise ValueError(f"max_receptacles must be None or >= 4, got {self.max_receptacles}")
        object.__setattr__(self, "exclude_tasks", tuple(sorted(set(self.exclude_tasks))))
        if self.floor_plans not in FLOOR_PLAN_SPLITS:
            raise ValueError(f"floor_plans must be one of {FLOOR_PLAN_SPLITS}, "
                             f"got {self.floor_plans!r}")

    def game_args(self, index: int) -> tuple:
        return (self.base_seed + index, self.task_types[index % len(self.task_types)],
                self.max_distractors, self.max_receptacles, frozenset(self.exclude_tasks),
                self.floor_plans, self.alfred_filter)

    @property
    def folder_name(self) -> str:
        types = "".join(str(TASK_TYPES.index(t) + 1) for t in self.task_types)
        name = (f"alfworld_{self.name}_t{types}_d{self.max_distractors}"
                f"_r{self.max_receptacles or 'all'}_s{self.base_seed}_n{self.num_games}")
        if self.exclude_tasks:
            digest = hashlib.sha1("\n".join(self.exclude_tasks).encode()).hexdigest()[:10]
            name += f"_x{digest}"
        if self.alfred_filter:
            name += "_alfred"
        if self.floor_plans != "all":
            name += f"_p{self.floor_plans}"
        return name


def _spec_record(spec: AlfworldSetSpec) -> dict:
    """The spec as the manifest stores it; the fields an unfiltered set on every floor plan
    leaves at those values are left out, so its manifest reads as before they existed."""
    record = json.loads(json.dumps(dataclasses.asdict(spec)))
    if not spec.alfred_filter and spec.floor_plans == "all":
        del record["alfred_filter"], record["floor_plans"]
    return record


def task_names(files: Sequence[str | os.PathLike]) -> set[str]:
    """The task folder names (`<type>-<Obj>-None-<Recep>-<scene>`) of a set's game files."""
    return {Path(f).parent.parent.name for f in files}


def _make_one(args: tuple) -> GeneratedGame:
    return generate_game(*args)


def generate_game_set(spec: AlfworldSetSpec, data_dir: str | os.PathLike, workers: int = 1,
                      progress: Callable[[int, int], None] | None = None) -> list[Path]:
    """Make (or reuse) the set `spec` under `data_dir`; return its game files in order."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    folder = Path(data_dir) / spec.folder_name
    manifest_path = folder / MANIFEST
    if manifest_path.exists():
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest.get("spec") == _spec_record(spec):
            return [folder / g["dir"] / GAME_FILE for g in manifest["games"]]
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [spec.game_args(i) for i in range(spec.num_games)]
    records = []
    if workers == 1:
        results = map(_make_one, jobs)
        pool = None
    else:
        pool = worker_pool(workers)  # spawned: the parent may run JAX threads and hold fast-downward copies
        results = pool.map(_make_one, jobs)
    try:
        for generated in results:
            write_game(generated, folder)
            records.append(generated.record())
            if progress is not None:
                progress(len(records), spec.num_games)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    write_json_atomic(manifest_path, {"spec": _spec_record(spec), "games": records})   # a temporary file of its own
    return [folder / g["dir"] / GAME_FILE for g in records]
