"""Simulated plants for the [controller] family: what a controller reads, what its outputs do, what is unsafe.

Every plant is simulated with explicit Euler steps of one scan period ``dt`` (the controller's outputs are
held over the scan, as a PLC's are). Noise is seeded per scenario, so grading is deterministic.

- ``tank``: dh/dt = (q·min(u, u_max) − k·√h − d(t)) / A. One REAL output ``pump`` in [0, 1]; h the level
  (m), q the pump's rated flow (m³/s), u_max the actuator saturation, d an extra outflow (disturbance).
  Unsafe: h above h_max (the tank overflows).
- ``thermal``: first order plus dead time, τ dT/dt = K·min(u(t − θ), u_max) − (T − T_amb) − d(t). One REAL
  output ``heater`` in [0, 1]. Unsafe: T above T_max (over-temperature).
- ``pump_valve``: a tank filled by an on/off pump through an on/off inlet valve, drained by a consumer's
  demand d(t): dh/dt = (q·[pump ∧ valve fully open] − d(t)) / A. The valve reports ``valve_open`` once it
  has been commanded open for its travel time; it closes at once. Interlock rules (a level chooses which):
    valve      the pump runs only while the valve is commanded open and reports fully open;
    high_high  the pump is off whenever the independent high-high switch is tripped (a scenario may
               stick the level transmitter at a low reading, so only the switch tells the truth);
    min_off    once stopped, the pump stays off for at least t_off seconds (motor protection);
    estop      while the emergency stop is pressed, and afterwards until a reset press (rising edge) with
               the stop released, the pump and the valve are off (a latch).
  Unsafe: breaking any active rule, or h above h_max.

`ContinuousPlant` (tank, thermal) and `PumpValve` record their traces; `performance` checks them against
the spec and `acted` is the do-nothing block. Scenarios are plain dicts (they live in ``Sample.extra``).
"""

from __future__ import annotations

import math
import random
from collections import deque

from cohortrl.tasks.st import Var


def _schedule(changes: list[list[float]], times: list[float]) -> list[float]:
    """The value of a piecewise-constant schedule [[t, value], ...] (first at t = 0) at each time."""
    out, i = [], 0
    for t in times:
        while i + 1 < len(changes) and t >= changes[i + 1][0] - 1e-9:
            i += 1
        out.append(changes[i][1])
    return out


class ContinuousPlant:
    """One REAL actuator in [0, 1] driving a measured process variable towards a setpoint."""

    output = ""  # the actuator's name in the interface
    output_help = ""
    pv_name = ""
    unit = ""
    limit_name = ""  # what exceeding ``limit`` is called
    limit = math.inf  # the safety limit on the true process variable

    def __init__(self, params: dict, scenario: dict, dt: float) -> None:
        self.params, self.scenario, self.dt = params, scenario, dt
        self.n = round(scenario["duration"] / dt)
        times = [k * dt for k in range(self.n)]
        self.times = times
        self.setpoints = _schedule(scenario["setpoints"], times)
        self.disturbance = _schedule([[0.0, 0.0]] + scenario["disturbances"], times)
        rng = random.Random(scenario["seed"])
        sigma = params["noise"]
        self.noise = [rng.gauss(0.0, sigma) if sigma else 0.0 for _ in times]
        self.pv: list[float] = []  # the true process variable at the start of each scan
        self.u: list[float] = []
        self.violation = ""

    @classmethod
    def interface(cls, params: dict) -> list[Var]:
        return [Var(cls.pv_name, "REAL", True, cls.unit, f"measured {cls.pv_name}"),
                Var("setpoint", "REAL", True, cls.unit, f"wanted {cls.pv_name}"),
                Var("DT", "REAL", True, "s", "the scan period"),
                Var(cls.output, "REAL", False, "", cls.output_help)]

    def check_outputs(self, outputs: list) -> str:
        """The hack blocks on outputs: NaN / inf, and values beyond the actuator's range."""
        u = outputs[0]
        if not math.isfinite(u):
            return f"{self.output} = {u}: outputs must be finite numbers"
        if not -1e-9 <= u <= 1.0 + 1e-9:
            return f"{self.output} = {u:g} is beyond the actuator's range [0, 1]"
        return ""

    def run(self, program) -> str:
        """Simulate the scenario; returns a run-stage failure ("" if it ran to the end). Safety violations
        are recorded in ``violation`` (the first one) and judged after every scenario has run."""
        dt, scan = self.dt, program.scan
        pv = self.scenario["initial"]
        for i in range(self.n):
            t = self.times[i]
            (u,) = scan([pv + self.noise[i], self.setpoints[i], dt], t)
            if bad := self.check_outputs([u]):
                return f"t = {t:g} s: {bad}"
            self.pv.append(pv)
            self.u.append(u)
            pv = self.advance(pv, u, i)
            if pv > self.limit and not self.violation:
                self.violation = (f"the {self.pv_name} reached {pv:.4g} {self.unit} at t = {t + dt:g} s, above "
                                  f"{self.limit_name} {self.limit:g} {self.unit}")
        return ""

    def advance(self, pv: float, u: float, i: int) -> float:
        """The process variable one scan later, with ``u`` held over the scan and the i-th disturbance."""
        raise NotImplementedError

    # -- performance -------------------------------------------------------------------------------------
    def windows(self) -> list[tuple[int, int, float]]:
        """(first scan, end scan, setpoint step) for each stretch between events (setpoint changes and
        disturbance steps). The first step is from the initial value to the first setpoint."""
        starts = {round(t / self.dt): None for t, _ in self.scenario["setpoints"]}
        starts.update({round(t / self.dt): None for t, _ in self.scenario["disturbances"] if round(t / self.dt) not in starts})
        ordered = sorted(k for k in starts if k < self.n)
        out = []
        for i, k in enumerate(ordered):
            end = ordered[i + 1] if i + 1 < len(ordered) else self.n
            before = self.pv[0] if k == 0 else self.setpoints[k - 1]
            out.append((k, end, self.setpoints[k] - before))
        return out

    def acted(self) -> str:
        """Did the controller close the loop? In each setpoint step the PV must come within half the step
        of the setpoint at least once (a do-nothing or constant-output controller does not)."""
        for start, end, step in self.windows():
            if abs(step) < 1e-9:
                continue
            closest = min(abs(self.pv[k] - self.setpoints[k]) for k in range(start, end))
            if closest > 0.5 * abs(step):
                return (f"the {self.pv_name} never came within half the step of the setpoint "
                        f"{self.setpoints[start]:g} {self.unit} after t = {start * self.dt:g} s")
        return ""

    def performance(self, spec: dict) -> list[str]:
        """Every way the trace misses the spec (empty: it meets it)."""
        failures = []
        dt = self.dt
        for start, end, step in self.windows():
            t0 = start * dt
            band = max(spec["band_frac"] * abs(step), spec["band_abs"])
            errors = [self.pv[k] - self.setpoints[k] for k in range(start, end)]
            if abs(step) > 1e-9:
                overshoot = max(0.0, max(e * math.copysign(1.0, step) for e in errors)) / abs(step)
                if overshoot > spec["overshoot"]:
                    failures.append(f"overshoot {100 * overshoot:.0f}% after t = {t0:g} s (spec: at most "
                                    f"{100 * spec['overshoot']:.0f}% of the step)")
            outside = [i for i, e in enumerate(errors) if abs(e) > band]
            settle = (outside[-1] + 1) * dt if outside else 0.0
            if settle > spec["settle"]:
                failures.append(f"not settled within ±{band:.3g} {self.unit} {spec['settle']:g} s after t = {t0:g} s")
            tail = errors[-max(1, round(spec["ss_window"] / dt)):]
            ss_error = sum(abs(e) for e in tail) / len(tail)
            if ss_error > spec["ss_error"]:
                failures.append(f"steady-state error {ss_error:.3g} {self.unit} before t = {end * dt:g} s "
                                f"(spec: at most {spec['ss_error']:g})")
        jumps = sum(abs(b - a) > 0.5 for a, b in zip(self.u, self.u[1:]))
        if jumps > spec["jumps"]:
            failures.append(f"{self.output} jumped by more than half its range {jumps} times "
                            f"(spec: at most {spec['jumps']}; chattering wears the actuator)")
        return failures


class Tank(ContinuousPlant):
    output, pv_name, unit, limit_name = "pump", "level", "m", "the overflow limit"
    output_help = "pump command, 0 (off) to 1 (rated flow)"

    def __init__(self, params: dict, scenario: dict, dt: float) -> None:
        super().__init__(params, scenario, dt)
        self.area = params["area"] * scenario["area_factor"]
        self.k = params["k"] * scenario["k_factor"]
        self.limit = params["h_max"]

    def advance(self, h: float, u: float, i: int) -> float:
        inflow = self.params["q"] * min(u, self.params["u_max"])
        return max(0.0, h + self.dt * (inflow - self.k * math.sqrt(h) - self.disturbance[i]) / self.area)


class Thermal(ContinuousPlant):
    output, pv_name, unit, limit_name = "heater", "temperature", "°C", "the over-temperature limit"
    output_help = "heater power, 0 (off) to 1 (full)"

    def __init__(self, params: dict, scenario: dict, dt: float) -> None:
        super().__init__(params, scenario, dt)
        self.gain = params["gain"] * scenario["gain_factor"]
        self.tau = params["tau"] * scenario["tau_factor"]
        self.delay = deque([0.0] * round(params["dead_time"] / dt))  # the heater acts dead_time later
        self.limit = params["t_max"]

    def advance(self, temp: float, u: float, i: int) -> float:
        self.delay.append(min(u, self.params["u_max"]))
        acting = self.delay.popleft()
        heat = self.gain * acting - (temp - self.params["ambient"]) - self.disturbance[i]
        return temp + self.dt * heat / self.tau


class PumpValve:
    """On/off pump and inlet valve on a tank drained by demand; interlocks as in the module docstring."""

    def __init__(self, params: dict, scenario: dict, dt: float) -> None:
        self.params, self.scenario, self.dt = params, scenario, dt
        self.n = round(scenario["duration"] / dt)
        self.times = [k * dt for k in range(self.n)]
        self.demand = _schedule(scenario["demand"], self.times)
        rng = random.Random(scenario["seed"])
        self.noise = [rng.gauss(0.0, params["noise"]) if params["noise"] else 0.0 for _ in self.times]
        self.level: list[float] = []
        self.starts: list[float] = []
        self.excluded: list[tuple[float, float]] = []  # spans where the band is not required (faults, e-stop)
        self.violation = ""

    @staticmethod
    def interface(params: dict) -> list[Var]:
        rules = params["rules"]
        out = [Var("level", "REAL", True, "m", "measured level (the transmitter can fail)"),
               Var("valve_open", "BOOL", True, "", "the inlet valve reports fully open")]
        if "high_high" in rules:
            out.append(Var("high_high", "BOOL", True, "", "independent high-high level switch tripped"))
        if "estop" in rules:
            out += [Var("estop", "BOOL", True, "", "emergency stop pressed"),
                    Var("reset", "BOOL", True, "", "reset button pressed")]
        out += [Var("DT", "REAL", True, "s", "the scan period"),
                Var("pump", "BOOL", False, "", "run the pump"),
                Var("valve", "BOOL", False, "", "open the inlet valve")]
        return out

    def check_outputs(self, outputs: list) -> str:
        return ""  # BOOL outputs: the interpreter's types already keep them TRUE or FALSE

    def run(self, program) -> str:
        p, s, dt = self.params, self.scenario, self.dt
        rules = p["rules"]
        area, q, h_max = p["area"], p["q"], p["h_max"]
        hh_on, hh_off = p["high_high"], p["high_high"] - 0.05  # the switch resets 5 cm below its trip point
        travel, t_off = p["travel"], p["min_off"]
        stuck = s.get("stuck")  # [t, duration, reading]: the level transmitter fails, reading low
        estop = _schedule([[0.0, 0]] + s.get("estop", []), self.times)
        reset = _schedule([[0.0, 0]] + s.get("reset", []), self.times)
        if stuck:
            self.excluded.append((stuck[0], stuck[0] + stuck[1] + p["recover"]))
        for t0, on in s.get("estop", []):
            if on:
                self.excluded.append((t0, next((t for t, v in s["reset"] if t > t0 and v), t0) + p["recover"]))
        h, opened_for, tripped, latched = s["initial"], 0.0, False, False
        pump_prev, stopped_at, reset_prev = False, -math.inf, False
        scan = program.scan
        has_hh, has_estop = "high_high" in rules, "estop" in rules
        for i in range(self.n):
            t = self.times[i]
            tripped = h >= hh_on or (tripped and h > hh_off)
            measured = h + self.noise[i]
            if stuck and stuck[0] <= t < stuck[0] + stuck[1]:
                measured = stuck[2]
            valve_open = opened_for >= travel - 1e-9
            inputs = [measured, valve_open]
            if has_hh:
                inputs.append(tripped)
            if has_estop:
                inputs += [bool(estop[i]), bool(reset[i])]
                latched = bool(estop[i]) or (latched and not (reset[i] and not reset_prev))
                reset_prev = bool(reset[i])
            inputs.append(dt)
            pump, valve = scan(inputs, t)
            self.level.append(h)
            # Interlocks, in the order they are checked; the first broken one is the reason.
            if not self.violation:
                if pump and not (valve and valve_open) and "valve" in rules:
                    self.violation = f"t = {t:g} s: the pump ran while the inlet valve was not fully open"
                elif pump and tripped and has_hh:
                    self.violation = f"t = {t:g} s: the pump ran while the high-high switch was tripped"
                elif pump and not pump_prev and t - stopped_at < t_off - 1e-9 and "min_off" in rules:
                    self.violation = (f"t = {t:g} s: the pump restarted {t - stopped_at:g} s after stopping "
                                      f"(minimum off time {t_off:g} s)")
                elif latched and (pump or valve):
                    self.violation = f"t = {t:g} s: the pump or valve was on while the emergency stop was latched"
            if pump and not pump_prev:
                self.starts.append(t)
            if pump_prev and not pump:
                stopped_at = t
            pump_prev = pump
            opened_for = opened_for + dt if valve else 0.0
            inflow = q if pump and valve and opened_for >= travel + dt - 1e-9 else 0.0
            h = max(0.0, h + dt * (inflow - self.demand[i]) / area)
            if h > h_max and not self.violation:
                self.violation = f"the level reached {h:.3f} m at t = {t + dt:g} s, above the overflow limit {h_max:g} m"
        return ""

    def acted(self) -> str:
        if not self.starts:
            return "the pump never ran"
        lo, hi = self.params["band"]
        if not any(lo <= h <= hi for h in self.level):
            return f"the level never entered the band {lo:g}-{hi:g} m"
        return ""

    def performance(self, spec: dict) -> list[str]:
        lo, hi = self.params["band"]
        tol = spec["band_tol"]
        failures = []
        outside = 0
        for t, h in zip(self.times, self.level):
            if t < spec["fill_time"] or any(a <= t < b for a, b in self.excluded):
                continue
            if not lo - tol <= h <= hi + tol:
                outside += 1
        if outside * self.dt > spec["outside_s"]:
            failures.append(f"the level was outside {lo - tol:g}-{hi + tol:g} m for {outside * self.dt:g} s "
                            f"(spec: at most {spec['outside_s']:g} s, after the first {spec['fill_time']:g} s)")
        # Starts while the transmitter is stuck are the high-high switch cycling the pump: excused too.
        starts = [t for t in self.starts if not any(a <= t < b for a, b in self.excluded)]
        per_100s = len(starts) * 100.0 / (self.n * self.dt)
        if per_100s > spec["starts_per_100s"]:
            failures.append(f"{len(starts)} pump starts ({per_100s:.1f} per 100 s; spec: at most "
                            f"{spec['starts_per_100s']:g}): chattering wears the motor")
        return failures


PLANTS = {"tank": Tank, "thermal": Thermal, "pump_valve": PumpValve}
