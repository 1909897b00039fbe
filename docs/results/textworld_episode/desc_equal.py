"""Old (description tracked per turn) vs new (read once at reset): identical observations."""
import glob, sys, time
import numpy as np
from textworld import EnvInfos
from rollout_bridge.envs import textworld_env as tw
from rollout_bridge.envs.textworld_env import TextWorldEpisode, ObservationStyle, start_game

OLD = EnvInfos(admissible_commands=True, objective=True, description=True, won=True, lost=True,
               score=True, max_score=True, extras=["walkthrough"])

class Old(TextWorldEpisode):
    def reset(self):
        self.close()
        self._env = start_game(self.path, OLD)
        state = self._env.reset()
        self._rng = np.random.default_rng(self._shuffle_seed)
        self.commands, self.turns, self.done, self.won = [], 0, False, False
        self._draw_names()
        self.objective = state["objective"] or ""
        self.walkthrough = list(state.get("extra.walkthrough") or [])
        self.admissible = self._show(state["admissible_commands"])
        return self._observation(state["description"] or state.feedback)
    def _replay(self):
        self.close(); self._env = start_game(self.path, OLD); self._env.reset()
        for c in self.commands: self._env.step(c)

files = sorted(glob.glob('/tmp/fr_ship2/artifacts/textworld_games/*/*.z8'))
files = files[::int(sys.argv[1])] if len(sys.argv) > 1 else files
style = ObservationStyle(numbered_actions=True, shuffle_actions=True, free_text=False, max_feedback_chars=300)
t = {Old: 0.0, TextWorldEpisode: 0.0}; steps = wins = 0
for i, f in enumerate(files):
    trace = {}
    for cls in (Old, TextWorldEpisode):
        rng = np.random.default_rng(i)
        ep = cls(f, 12, style, (0, i))
        t0 = time.perf_counter()
        obs = [ep.reset()]; walk = list(ep.walkthrough)
        k = 0
        while not ep.done:
            # half the episodes follow the walkthrough (wins), half play at random
            if i % 2 and k < len(walk) and walk[k] in ep.admissible:
                reply = str(ep.admissible.index(walk[k]) + 1)
            else:
                reply = str(rng.integers(1, len(ep.admissible) + 2))
            out = ep.step(reply); k += 1
            obs.append((out.observation, out.reward, out.done, out.won, out.info.get("lost")))
        t[cls] += time.perf_counter() - t0
        trace[cls] = obs
        ep.close()
    assert trace[Old] == trace[TextWorldEpisode], (f, [a for a, b in zip(trace[Old], trace[TextWorldEpisode]) if a != b][:2])
    steps += len(obs) - 1; wins += obs[-1][3]
print(f"{len(files)} games, {steps} steps, {wins} won: identical observations; "
      f"old {t[Old]:.1f}s new {t[TextWorldEpisode]:.1f}s ({t[Old]/t[TextWorldEpisode]:.2f}x)")
