"""Generated ALFWorld games: all six task types, solvable by the planner, the stored
walkthrough wins when replayed under ALFWorld's wrappers, deterministic per seed, objects
only where alfworld's constants allow, only tasks ALFRED's task sampler would make (each of
its criteria), floor plans from ALFRED's train / test lists, malformed game files give a
clear error."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("alfworld")
pytest.importorskip("fast_downward")

from alfworld.gen import constants  # noqa: E402

from rollout_bridge.envs import alfworld_games as games  # noqa: E402
from rollout_bridge.envs.alfworld_env import AlfworldTasks  # noqa: E402

SIX = games.AlfworldSetSpec("test", num_games=6, base_seed=40, max_distractors=3)


@pytest.fixture(scope="module")
def game_set(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("alfworld_games")
    seen = []
    files = games.generate_game_set(SIX, data_dir, workers=2,
                                    progress=lambda done, total: seen.append((done, total)))
    return data_dir, files, seen


def _facts(problem: str, predicate: str) -> list[list[str]]:
    return [m.split() for m in re.findall(rf"\({predicate} ([^()]*)\)", problem)]


def test_set_has_six_task_types_each_solvable_and_progress_shown(game_set):
    _, files, seen = game_set
    assert len(files) == 6 and seen[-1] == (6, 6)
    types = []
    for path in files:
        game = games.read_game_file(path)
        assert game["solvable"] is True and game["walkthrough"]
        traj = json.loads((path.parent / games.TRAJ_DATA).read_text())
        types.append(traj["task_type"])
        assert path.parent.parent.name.startswith(traj["task_type"] + "-")
        assert traj["generated"]["task"] in game["grammar"]
        assert games.GOAL_PLACEHOLDER not in game["grammar"]
        assert games.alfred_exclusions(*games.game_start_state(path)) == ()
    assert sorted(types) == sorted(games.TASK_TYPES)


def test_walkthrough_replay_wins_and_no_game_starts_won(game_set):
    data_dir, files, _ = game_set
    tasks = AlfworldTasks(files, data_dir / SIX.folder_name)
    try:
        for task_id in range(tasks.num_tasks):
            episode = tasks.episode(task_id)
            episode.reset()
            assert not episode.won
            traj = json.loads((__import__("pathlib").Path(episode.path).parent
                               / games.TRAJ_DATA).read_text())
            assert episode.objective == traj["generated"]["task"] + "."
            for command in episode.walkthrough:
                assert command in episode.admissible      # every step is a legal command
                outcome = episode.step(command)
            assert outcome.won and outcome.reward == 1.0 and outcome.done
            episode.close()
    finally:
        tasks.close()


def test_objects_placed_only_where_constants_allow_and_openables_closed(game_set):
    _, files, _ = game_set
    for path in files:
        problem = games.read_game_file(path)["pddl_problem"].split("(:goal")[0]   # init only
        otype = {o: t for o, t in _facts(problem, "objectType")}
        rtype = {r: t for r, t in _facts(problem, "receptacleType")}
        assert "(opened " not in problem
        for obj, rec in _facts(problem, "inReceptacle"):
            o, r = otype[obj].removesuffix("Type"), rtype[rec].removesuffix("Type")
            if o in games.LAMP_TYPES:
                assert r in games.LAMP_RECEPTACLES
            else:
                assert o in constants.VAL_RECEPTACLE_OBJECTS[r], (o, r)
        for rec in rtype:
            openable = rtype[rec].removesuffix("Type") in constants.OPENABLE_CLASS_SET
            assert (f"(openable {rec})" in problem) == openable


def test_same_seed_same_game_other_seed_other_game():
    first = games.generate_game(7, "pick_heat_then_place_in_recep", max_distractors=2)
    again = games.generate_game(7, "pick_heat_then_place_in_recep", max_distractors=2)
    other = games.generate_game(8, "pick_heat_then_place_in_recep", max_distractors=2)
    assert first == again
    assert first.game["pddl_problem"] != other.game["pddl_problem"]


def test_complete_set_is_reused_not_regenerated(game_set, monkeypatch):
    data_dir, files, _ = game_set

    def refuse(*args):
        raise AssertionError("a complete set must not be generated again")
    monkeypatch.setattr(games, "generate_game", refuse)
    assert games.generate_game_set(SIX, data_dir) == files


def test_mangled_ids_and_locations():
    assert games.mangle("Apple|+00.30|-01.20") == "Apple_bar__plus_00_dot_30_bar__minus_01_dot_20"
    assert games.location_id((0.25, -1.75, 180, 30)) == "loc_bar_1_bar__minus_7_bar_2_bar_30"
    a, b = "loc_bar_1_bar__minus_7_bar_2_bar_30", "loc_bar_3_bar__minus_7_bar_0_bar_30"
    assert games.grid_distance(a, b) == 2 + 2 + 1


@pytest.mark.parametrize("content, field", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"pddl_domain": "(define)", "grammar": "g"}), "'pddl_problem'"),
    (json.dumps({"pddl_domain": "d", "grammar": "g", "pddl_problem": "p", "solvable": False}),
     "unsolvable"),
])
def test_malformed_game_file_gives_clear_error(tmp_path, content, field):
    path = tmp_path / "trial" / games.GAME_FILE
    path.parent.mkdir()
    path.write_text(content)
    with pytest.raises(games.GameFileError, match=re.escape(field)) as err:
        games.read_game_file(path)
    assert str(path) in str(err.value)
    tasks = AlfworldTasks.from_folder(tmp_path)      # the env refuses it with the same error
    with pytest.raises(games.GameFileError, match=re.escape(str(path))):
        tasks.episode(0).reset()
    tasks.close()


def test_bad_spec_fields_named():
    with pytest.raises(ValueError, match="task_types"):
        games.AlfworldSetSpec("x", 1, 0, task_types=("pick_and_fly",))
    with pytest.raises(ValueError, match="num_games"):
        games.AlfworldSetSpec("x", 0, 0)
    with pytest.raises(ValueError, match="task_type"):
        games.generate_game(0, "pick_and_fly")


# Games the generator made before it applied ALFRED's criteria, at the CPU recipe's sizes
# (2 distractors, 6 receptacles): seed, task type, the criterion ALFRED's sampler rejects.
UNFILTERED_EXCLUDED = [
    (2, "pick_heat_then_place_in_recep", "object_in_appliance"),    # a tomato in the microwave
    (3, "pick_cool_then_place_in_recep", "object_in_appliance"),    # a potato in the fridge
    (0, "pick_clean_then_place_in_recep", "object_in_appliance"),   # a dish sponge in the sink
    (4, "pick_heat_then_place_in_recep", "goal_is_appliance"),      # heat an egg, put it in the microwave
    (46, "look_at_obj_in_light", "room_type"),                      # a floor lamp in bathroom 417
]


def _written(generated, folder):
    return games.write_game(generated, folder)


@pytest.mark.parametrize("seed, task_type, criterion", UNFILTERED_EXCLUDED)
def test_unfiltered_draw_is_excluded_by_the_named_criterion(tmp_path, seed, task_type, criterion):
    unfiltered = games.generate_game(seed, task_type, max_distractors=2, max_receptacles=6,
                                     alfred_filter=False)
    draw, objects = games.game_start_state(_written(unfiltered, tmp_path))
    assert criterion in {e.criterion for e in games.alfred_exclusions(draw, objects)}


@pytest.mark.parametrize("seed, task_type, criterion", UNFILTERED_EXCLUDED)
def test_generated_game_is_one_alfred_would_sample(tmp_path, seed, task_type, criterion):
    """Read from the game's own files: the target never starts in the task's appliance, the
    goal receptacle is not the appliance, light tasks are in living rooms or bedrooms."""
    path = _written(games.generate_game(seed, task_type, max_distractors=2, max_receptacles=6),
                    tmp_path)
    traj = json.loads((path.parent / games.TRAJ_DATA).read_text())
    params = traj["pddl_params"]
    scene = int(traj["scene"]["floor_plan"].removeprefix("FloorPlan"))
    init = games.read_game_file(path)["pddl_problem"].split("(:goal")[0]
    otype = {o: t.removesuffix("Type") for o, t in _facts(init, "objectType")}
    rtype = {r: t.removesuffix("Type") for r, t in _facts(init, "receptacleType")}
    starts_in = {rtype[r] for o, r in _facts(init, "inReceptacle")
                 if otype[o] == params["object_target"]}
    appliance = {"pick_clean_then_place_in_recep": "SinkBasin",
                 "pick_heat_then_place_in_recep": "Microwave",
                 "pick_cool_then_place_in_recep": "Fridge"}.get(task_type)
    if appliance is not None:
        assert appliance not in starts_in and params["parent_target"] != appliance
    if task_type == "look_at_obj_in_light":
        assert 201 <= scene <= 230 or 301 <= scene <= 330      # living rooms, bedrooms
    assert traj["generated"]["excluded"][criterion] >= 1     # the unfiltered draw, re-drawn


def _draw(task_type, scene=10, obj="Apple", recep="CounterTop", toggle=""):
    return games.TaskDraw(task_type, scene, obj, recep, toggle)


HEAT, COOL, CLEAN = ("pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep",
                     "pick_clean_then_place_in_recep")
TWO, LIGHT = "pick_two_obj_and_place", "look_at_obj_in_light"


EXCLUDED_CASES = [
    (_draw(LIGHT, 417, "SprayBottle", "", "FloorLamp"),
     [("SprayBottle", "Shelf"), ("FloorLamp", "CounterTop")], "room_type"),     # a bathroom
    (_draw(HEAT, 210), [("Apple", "CounterTop")], "room_type"),                  # a living room
    (_draw(COOL, 10, "Book"), [("Book", "CounterTop")], "object_action"),       # not Coolable
    (_draw(HEAT, 10), [("Apple", "Microwave")], "object_in_appliance"),
    (_draw(COOL, 10), [("Apple", "CounterTop"), ("Apple", "Fridge")], "object_in_appliance"),
    (_draw(CLEAN, 10, "Mug", "Cabinet"), [("Mug", "SinkBasin")], "object_in_appliance"),
    (_draw(HEAT, 10, recep="Microwave"), [("Apple", "CounterTop")], "goal_is_appliance"),
    (_draw(CLEAN, 10, "Mug", "SinkBasin"), [("Mug", "Cabinet")], "goal_is_appliance"),
    (_draw(TWO, 10, "Pen", "Desk"), [("Pen", "Shelf")], "fewer_than_two"),
    (_draw(TWO, 310, "Pen", "Desk"), [("Pen", "Shelf"), ("Pen", "Drawer"), ("Pencil", "Desk")],
     "goal_holds_object_type"),                   # ALFRED matches ids by substring
    (_draw(LIGHT, 310, "Book", "", "DeskLamp"), [("Book", "Bed")], "toggle_target"),
]


@pytest.mark.parametrize("draw, objects, criterion", EXCLUDED_CASES)
def test_each_alfred_criterion_excludes_its_case(draw, objects, criterion):
    assert [e.criterion for e in games.alfred_exclusions(draw, objects)] == [criterion]


def test_every_criterion_has_a_case():
    assert {case[-1] for case in EXCLUDED_CASES} == set(games.ALFRED_CRITERIA)


@pytest.mark.parametrize("draw, objects", [
    (_draw(HEAT, 10, recep="Fridge"), [("Apple", "CounterTop"), ("Mug", "Microwave")]),
    (_draw(CLEAN, 410, "SoapBar", "Toilet"), [("SoapBar", "Cabinet")]),          # a bathroom
    (_draw(TWO, 310, "Pen", "Desk"), [("Pen", "Shelf"), ("Pen", "Drawer"), ("Book", "Desk")]),
    (_draw(LIGHT, 310, "Book", "", "DeskLamp"), [("Book", "Bed"), ("DeskLamp", "Desk")]),
    (_draw("pick_and_place_simple", 410, "SoapBar", "Toilet"), [("SoapBar", "Cabinet")]),
])
def test_tasks_alfred_samples_pass(draw, objects):
    assert games.alfred_exclusions(draw, objects) == ()


def test_floor_plan_splits_are_alfreds_lists():
    train, test = games.split_floor_plans("train"), games.split_floor_plans("test")
    assert set(train) == set(constants.TRAIN_SCENE_NUMBERS) and len(train) == 96
    assert set(test) == set(constants.TEST_SCENE_NUMBERS) and len(test) == 24
    assert sorted(train + test) == list(games.split_floor_plans("all"))
    for task_type in games.TASK_TYPES:
        for seed in range(30):
            for split, plans in (("train", train), ("test", test)):
                draw = games.draw_task(__import__("random").Random(seed), task_type,
                                       floor_plans=split)
                assert draw.scene in plans
    with pytest.raises(ValueError, match="floor_plans"):
        games.AlfworldSetSpec("x", 1, 0, floor_plans="valid")


def test_unfiltered_set_on_every_plan_keeps_the_folder_and_manifest_of_before():
    """Sets cached before the filter and the floor-plan split existed are reused as they are."""
    old = games.AlfworldSetSpec("train", 128, 0, max_distractors=2, max_receptacles=6,
                                alfred_filter=False)
    assert old.folder_name == "alfworld_train_t123456_d2_r6_s0_n128"
    assert set(games._spec_record(old)) == {"name", "num_games", "base_seed", "task_types",
                                            "max_distractors", "max_receptacles", "exclude_tasks"}
    new = games.AlfworldSetSpec("train", 128, 0, max_distractors=2, max_receptacles=6,
                                floor_plans="train")
    assert new.folder_name == "alfworld_train_t123456_d2_r6_s0_n128_alfred_ptrain"
