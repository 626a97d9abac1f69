"""[controller] Write a Structured Text (IEC 61131-3) controller for a simulated plant; graded by simulation.

Levels:
  1  tank level, continuous pump 0-1, no noise, no saturation, loose spec (a proportional controller with
     a high gain passes), scan 0.1 or 0.2 s
  2  tank level with sensor noise, a pump that saturates below its rated flow (anti-windup matters), an
     outflow disturbance, tighter spec, scan 0.1-0.5 s
  3  first-order-plus-dead-time heater (dead time 2-6 s), noise, saturation, a heat-loss disturbance and an
     over-temperature limit: a tuned PI controller
  4  on/off pump and inlet valve keeping a tank level within a band, 2 interlock rules: the pump runs only
     through a fully open valve; the independent high-high switch stops it (a hidden scenario sticks
     the level transmitter at a low reading); a limit on pump starts
  5  as 4 with 4 rules: + a minimum pump off time (TON) and an emergency-stop latch with reset (SR, R_TRIG)
Plants, equations and interlock rules: `cohortrl.tasks.plants`. The language: `cohortrl.tasks.st`.

Grading is staged; the steps are the stages, each passed only if every earlier one was:
  parse        the answer's code block parses, stays inside the subset, type-checks against the
               interface, assigns every output and is at most ``max_nodes`` operations per scan;
  run          every scenario (``visible`` shown in the prompt, ``hidden`` not) runs to its end with no
               runtime error, every output finite and inside the actuator's range at every scan (the
               NaN/inf and beyond-the-limits blocks), and the controller acts: the process variable gets
               within half of each setpoint step (continuous plants) or the pump runs and the level
               reaches the band (on/off plants) — the do-nothing block;
  safety       no safety violation in any scenario (level or temperature limit, every interlock rule);
  performance  every scenario meets the spec: overshoot, settling time, steady-state error, actuator
               jumps or pump starts, time outside the band.
outcome = 1 only when all four pass. Open-loop timetables are blocked by the hidden scenarios: their event
times, setpoints, demands and faults are drawn afresh (and the plant's parameters vary by up to 10%), so a
schedule fitted to the visible scenario misses them. The failing stage's reason is in its step's ``written``;
`Controller.evaluate` gives the whole report.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from cohortrl.grading.answer_format import format_sig
from cohortrl.tasks.base import Grade, Sample, Step, StepResult, TaskFamily, make_grade, register, rng_for, round_nice
from cohortrl.tasks.code_blocks import extract_code
from cohortrl.tasks.plants import PLANTS
from cohortrl.tasks.st import STError, compile_program

STAGES = ("parse", "run", "safety", "performance")

# What each level draws from. Specs are per level and scaled by the ``tightness`` knob.
LEVELS = {
    1: {"plant": "tank", "noise": 0.0, "u_max": (1.0, 1.0), "dts": (0.1, 0.2), "disturbance": False,
        "spec": {"overshoot": 0.3, "band_frac": 0.05, "band_abs": 0.02, "ss_error": 0.04}},
    2: {"plant": "tank", "noise": 0.004, "u_max": (0.85, 0.95), "dts": (0.1, 0.2, 0.5), "disturbance": True,
        "spec": {"overshoot": 0.3, "band_frac": 0.05, "band_abs": 0.015, "ss_error": 0.012}},
    3: {"plant": "thermal", "noise": 0.1, "u_max": (0.85, 1.0), "dts": (0.5, 1.0), "disturbance": True,
        "spec": {"overshoot": 0.2, "band_frac": 0.05, "band_abs": 0.5, "ss_error": 1.5}},
    4: {"plant": "pump_valve", "noise": 0.003, "dts": (0.2, 0.5), "rules": ("valve", "high_high"),
        "spec": {"band_tol": 0.03}},
    5: {"plant": "pump_valve", "noise": 0.005, "dts": (0.2, 0.5), "rules": ("valve", "high_high", "min_off", "estop"),
        "spec": {"band_tol": 0.03}},
}
SS_WINDOW = 5.0  # seconds before each event over which the steady-state error is averaged


@dataclass(frozen=True)
class Evaluation:
    """Everything `grade` knows: the stages passed, and why the next one failed."""

    passed: list[str]  # the stages passed, in order
    reason: str  # why the first failing stage failed ("" if all passed)
    code_span: tuple[int, int] | None  # where the graded code was read from
    failures: list[str] = field(default_factory=list)  # every performance miss, when performance failed

    @property
    def outcome(self) -> float:
        return 1.0 if len(self.passed) == len(STAGES) else 0.0


@register
@dataclass(frozen=True)
class Controller(TaskFamily):
    name = "controller"
    levels = (1, 2, 3, 4, 5)
    tightness: float = 1.0  # spec limits are multiplied by this (0.5: twice as strict)
    noise: float = 1.0  # sensor noise is multiplied by this
    visible: int = 1  # scenarios described in the prompt
    hidden: int = 3  # scenarios graded but not described
    max_nodes: int = 2000  # operations per scan a program may have

    # -- generation --------------------------------------------------------------------------------------
    def make_sample(self, seed: int, level: int, index: int) -> Sample:
        rng = rng_for(self.name, seed, level, index)
        config = LEVELS[level]
        dt = rng.choice(config["dts"])
        draw = {"tank": draw_tank, "thermal": draw_thermal, "pump_valve": draw_pump_valve}[config["plant"]]
        params, spec, scenarios, reference = draw(rng, config, dt, self.visible + self.hidden, self.noise)
        for key in ("overshoot", "settle", "ss_error", "outside_s"):
            if key in spec:
                spec[key] = round(spec[key] * self.tightness, 4)
        for i, scenario in enumerate(scenarios):
            scenario["name"] = f"visible {i + 1}" if i < self.visible else f"hidden {i + 1 - self.visible}"
            scenario["seed"] = f"{self.name}/{seed}/{level}/{index}/{i}"
        extra = {"plant": config["plant"], "dt": dt, "params": params, "spec": spec, "scenarios": scenarios}
        prompt = write_prompt(extra, self.visible, self.hidden)
        reference_solution = f"```st\n{reference}\n```"
        steps = [Step(stage, "1") for stage in STAGES]
        return Sample(self.name, level, seed, index, prompt, answer="passes: " + ", ".join(STAGES),
                      reference_solution=reference_solution, target=steps[-1], steps=steps, extra=extra)

    # -- grading -----------------------------------------------------------------------------------------
    def grade(self, sample: Sample, completion: str) -> Grade:
        report = self.evaluate(sample, completion)
        results = []
        for stage in STAGES:
            passed = stage in report.passed
            failing = not passed and len(results) == len(report.passed)
            span = report.code_span if passed or failing else None
            results.append(StepResult(stage, passed, span, report.reason if failing else None))
        return make_grade(report.outcome, results, report.code_span is not None, self.step_weight)

    def evaluate(self, sample: Sample, completion: str) -> Evaluation:
        found = extract_code(completion, marker=":=")
        if found is None:
            return Evaluation([], "no code block found (answer with the program in a ```st block)", None)
        code, span = found
        extra = sample.extra
        plant_class = PLANTS[extra["plant"]]
        try:
            program = compile_program(code, plant_class.interface(extra["params"]), self.max_nodes)
        except STError as e:
            return Evaluation([], str(e), span)

        traces = []
        for scenario in extra["scenarios"]:
            plant = plant_class(extra["params"], scenario, extra["dt"])
            program.reset()
            try:
                error = plant.run(program)
            except STError as e:
                error = str(e)
            error = error or plant.acted()
            if error:
                return Evaluation(["parse"], f"scenario {scenario['name']}: {error}", span)
            traces.append((scenario["name"], plant))

        for name, plant in traces:
            if plant.violation:
                return Evaluation(["parse", "run"], f"scenario {name}: {plant.violation}", span)

        failures = [f"scenario {name}: {miss}" for name, plant in traces for miss in plant.performance(extra["spec"])]
        if failures:
            return Evaluation(["parse", "run", "safety"], failures[0], span, failures)
        return Evaluation(list(STAGES), "", span)


# ---------------------------------------------------------------------------------------------------------
# Drawing plants, scenarios and reference controllers. Each returns (params, spec, scenarios, reference).


def on_grid(t: float, dt: float) -> float:
    """A time on the scan grid, so events fall exactly on a scan."""
    return round(round(t / dt) * dt, 6)


def draw_tank(rng: random.Random, config: dict, dt: float, n_scenarios: int, noise: float):
    area = round_nice(rng.uniform(0.1, 0.25), 2)
    q = round_nice(rng.uniform(0.04, 0.08), 2)
    k = round_nice(q / math.sqrt(rng.uniform(2.6, 3.4)), 3)  # full pump would fill to 2.6-3.4 m: overflow
    u_max = round(rng.uniform(*config["u_max"]), 2)
    params = {"area": area, "q": q, "k": k, "u_max": u_max, "h_max": 2.0, "noise": config["noise"] * noise}

    disturbance = 0.15 if config["disturbance"] else 0.0  # the largest extra outflow, as a fraction of q

    def setpoint(near: float | None = None) -> float:
        # Leave the controller headroom: the steady-state command with k 10% higher and the largest
        # disturbance must stay below 90% of the saturation (0.3 m always qualifies, so this ends).
        while True:
            sp = round(rng.uniform(0.3, 1.4) * 20) / 20
            if (1.1 * k * math.sqrt(sp) / q + disturbance <= 0.9 * u_max
                    and (near is None or 0.15 <= abs(sp - near) <= 0.45)):
                return sp

    def ramp(h0: float, sp: float, k_factor: float, area_factor: float) -> float:
        """How long the level takes to get from h0 to sp with the pump at 90% of its saturation (rising)
        or off (falling), at the slowest rate on the way: the least time any controller needs."""
        outflow = k * k_factor * math.sqrt(sp)
        rate = (0.9 * q * u_max - outflow if sp > h0 else outflow) / (area * area_factor)
        return abs(sp - h0) / rate

    tc = 1.5  # the reference's closed-loop time constant (s)
    drawn = []
    for i in range(n_scenarios):
        sp1 = setpoint()
        sp2 = setpoint(near=sp1)
        factors = (round(rng.uniform(0.9, 1.1), 3), round(rng.uniform(0.9, 1.1), 3)) if i else (1.0, 1.0)
        initial = round(max(0.05, sp1 - rng.uniform(0.2, 0.5)), 2)
        drawn.append((initial, sp1, sp2, factors, max(ramp(initial, sp1, *factors), ramp(sp1, sp2, *factors))))
    # One settling time for the sample: the slowest ramp of any scenario plus four closed-loop time
    # constants and a margin, in whole 5 s.
    settle = 5.0 * math.ceil((max(d[-1] for d in drawn) + 4 * tc + 8) / 5)
    scenarios = []
    for initial, sp1, sp2, (k_factor, area_factor), _ in drawn:
        change = on_grid(settle + rng.uniform(10, 25), dt)
        disturbances, end = [], change + settle + 10
        if config["disturbance"]:
            at = on_grid(end + rng.uniform(0, 10), dt)
            disturbances = [[at, round_nice(rng.uniform(0.1, disturbance) * q, 2)]]
            end = at + settle + 10
        scenarios.append({"initial": initial, "setpoints": [[0.0, sp1], [change, sp2]], "disturbances": disturbances,
                          "duration": on_grid(end, dt), "k_factor": k_factor, "area_factor": area_factor})
    spec = dict(config["spec"], settle=settle, ss_window=SS_WINDOW, jumps=6)
    # Steady state: q u = k √h, so the feedforward is u = (k / q) √setpoint; PI feedback corrects what that
    # model gets wrong. Linearised at h, the tank is a first-order lag with gain 2q√h/k and time constant
    # 2A√h/k; SIMC tuning (Skogestad 2003) for a closed-loop time constant tc gives Kc = A / (q tc) and
    # Ti = min(tau, 4 tc), tau taken at 0.5 m.
    ti = min(2 * area * math.sqrt(0.5) / k, 4 * tc)
    reference = pi_reference("level", "pump", area / (q * tc), ti, u_max, f"{format_sig(k / q)} * SQRT(setpoint)")
    return params, spec, scenarios, reference


def draw_thermal(rng: random.Random, config: dict, dt: float, n_scenarios: int, noise: float):
    gain = float(rng.randint(8, 16) * 5)  # °C of rise at full power
    tau = float(rng.randint(4, 12) * 5)
    dead_time = on_grid(rng.uniform(2, 6), dt)
    u_max = round(rng.uniform(*config["u_max"]), 2)
    ambient = 20.0
    params = {"gain": gain, "tau": tau, "dead_time": dead_time, "ambient": ambient, "u_max": u_max,
              "t_max": round(ambient + 0.8 * gain * u_max), "noise": config["noise"] * noise}

    def setpoint(near: float | None = None) -> float:
        while True:
            sp = float(round(ambient + rng.uniform(0.3, 0.6) * gain * u_max))
            if near is None or 0.1 * gain <= abs(sp - near) <= 0.25 * gain:
                return sp

    def ramp(t0: float, sp: float, gain_factor: float, tau_factor: float) -> float:
        """The least time to get from t0 to sp: heating at 90% of the saturation, or cooling unheated."""
        final = ambient + 0.9 * u_max * gain * gain_factor if sp > t0 else ambient
        return tau * tau_factor * math.log((final - t0) / (final - sp)) + dead_time

    # SIMC with tc = 1.5 theta: Kc = tau / (K (tc + theta)), Ti = min(tau, 4 (tc + theta)).
    tc = 1.5 * dead_time
    drawn = []
    for i in range(n_scenarios):
        sp1 = setpoint()
        sp2 = setpoint(near=sp1)
        factors = (round(rng.uniform(0.9, 1.1), 3), round(rng.uniform(0.9, 1.1), 3)) if i else (1.0, 1.0)
        drawn.append((sp1, sp2, factors, max(ramp(ambient, sp1, *factors), ramp(sp1, sp2, *factors))))
    settle = 5.0 * math.ceil((max(d[-1] for d in drawn) + 4 * (tc + dead_time) + 10) / 5)
    scenarios = []
    for sp1, sp2, (gain_factor, tau_factor), _ in drawn:
        change = on_grid(settle + rng.uniform(10, 20), dt)
        at = on_grid(change + settle + rng.uniform(10, 20), dt)
        scenarios.append({
            "initial": ambient, "setpoints": [[0.0, sp1], [change, sp2]],
            "disturbances": [[at, round(rng.uniform(0.05, 0.1) * gain, 1)]],
            "duration": on_grid(at + settle + 10, dt), "gain_factor": gain_factor, "tau_factor": tau_factor,
        })
    spec = dict(config["spec"], settle=settle, ss_window=SS_WINDOW, jumps=6)
    # No feedforward here: during the dead time it and the PI would both push, and overshoot.
    reference = pi_reference("temperature", "heater", tau / (gain * (tc + dead_time)), min(tau, 4 * (tc + dead_time)),
                             u_max, None)
    return params, spec, scenarios, reference


def pi_reference(pv: str, out: str, kc: float, ti: float, u_max: float, feedforward: str | None) -> str:
    """The reference for continuous plants: PI feedback, plus the model's steady-state output for the
    setpoint (feedforward) where given. The integral stops while the output is saturated and the error
    would push it further (conditional integration: no windup)."""
    bias = "ff + " if feedforward else ""
    return f"""VAR
    e : REAL;{chr(10) + "    ff : REAL;" if feedforward else ""}
    i_term : REAL := 0.0;
    u : REAL;
END_VAR
e := setpoint - {pv};{chr(10) + "ff := " + feedforward + ";" if feedforward else ""}
u := {bias}{format_sig(kc)} * e + i_term;
IF NOT ((u >= {u_max:g} AND e > 0.0) OR (u <= 0.0 AND e < 0.0)) THEN
    i_term := i_term + {format_sig(kc / ti)} * DT * e;
END_IF;
{out} := LIMIT(0.0, u, {u_max:g});"""


def draw_pump_valve(rng: random.Random, config: dict, dt: float, n_scenarios: int, noise: float):
    rules = list(config["rules"])
    q = round_nice(rng.uniform(0.03, 0.06), 2)
    d_max = 0.5 * q
    lo = round(rng.uniform(0.8, 1.0), 2)
    hi = round(lo + rng.uniform(0.3, 0.5), 2)
    high_high = round(hi + 0.3, 2)
    travel = on_grid(rng.uniform(1, 3), dt)
    min_off = float(rng.randint(5, 15)) if "min_off" in rules else 0.0
    # Draining through the band (less 5 cm at each edge) at the largest demand must take longer than the
    # pump's rest and the valve's travel, with a margin, or no controller could keep the level in the band.
    area = round_nice(max(rng.uniform(1.0, 2.0), 1.2 * (min_off + travel + 2) * d_max / (hi - lo - 0.1)), 2)
    refill = area * hi / (q - d_max)  # from empty at the largest demand
    params = {"area": area, "q": q, "band": [lo, hi], "high_high": high_high, "h_max": round(high_high + 0.25, 2),
              "travel": travel, "min_off": min_off, "rules": rules, "noise": config["noise"] * noise,
              "recover": round(refill + travel + min_off + 10)}
    scenarios = []
    for i in range(n_scenarios):
        duration = on_grid(rng.uniform(220, 260), dt)
        t, demand = 0.0, []
        while t < duration:
            demand.append([on_grid(t, dt), round_nice(rng.uniform(0.2, 0.5) * q, 2)])
            t += rng.uniform(30, 60)
        scenario = {"initial": round(rng.uniform(0.3, 0.6), 2), "demand": demand, "duration": duration}
        # The level transmitter sticks at a low reading in one scenario of every two (the first hidden one
        # always): a controller that trusts it keeps pumping, and only the high-high switch stops it.
        if "high_high" in rules and (i == 1 or (i > 1 and rng.random() < 0.5)):
            scenario["stuck"] = [on_grid(rng.uniform(60, 120), dt), on_grid(rng.uniform(60, 90), dt),
                                 round(lo - rng.uniform(0.15, 0.3), 2)]
        if "estop" in rules:
            press = on_grid(rng.uniform(40, duration - 100), dt)
            release = on_grid(press + rng.uniform(3, 8), dt)
            reset = on_grid(release + rng.uniform(2, 6), dt)
            scenario["estop"] = [[press, 1], [release, 0]]
            scenario["reset"] = [[reset, 1], [on_grid(reset + 1, dt), 0]]
        scenarios.append(scenario)
    initial_low = min(s["initial"] for s in scenarios)
    # A hysteresis controller using the band h cycles fastest at demand q/2 (the largest here), every
    # 4 A h / q seconds; the spec allows twice the rate of one using the whole band.
    starts = math.ceil(2 * 100 * q / (4 * area * (hi - lo)))
    # Time to reach the band from the lowest start: the pump waits (valve travel, rest) while the demand
    # drains the tank, then fills at the net rate.
    wait = travel + min_off
    fill_time = round((area * (lo - initial_low) + d_max * wait) / (q - d_max) + wait + 15)
    spec = dict(config["spec"], fill_time=fill_time,
                outside_s=10.0, starts_per_100s=float(starts))
    reference = pump_valve_reference(params)
    return params, spec, scenarios, reference


def pump_valve_reference(params: dict) -> str:
    """Hysteresis between the band's edges (5 cm inside), every active interlock written out."""
    lo, hi = params["band"]
    rules = params["rules"]
    decls = ["    running : BOOL := FALSE;"]
    lines = []
    permit = ["valve_open"]
    if "high_high" in rules:
        permit.append("NOT high_high")
    if "estop" in rules:
        decls += ["    stopped : SR;        (* the emergency-stop latch *)", "    reset_edge : R_TRIG;"]
        lines += ["reset_edge(CLK := reset);", "stopped(S1 := estop, R := reset_edge.Q AND NOT estop);",
                  "valve := NOT stopped.Q1;"]
        permit.append("NOT stopped.Q1")
    else:
        lines.append("valve := TRUE;")
    if "min_off" in rules:
        decls.append("    rested : TON;        (* minimum off time before a restart *)")
        lines.append(f"rested(IN := NOT running, PT := T#{params['min_off']:g}s);")
        start = f"level < {lo + 0.05:g} AND rested.Q"
    else:
        start = f"level < {lo + 0.05:g}"
    lines += [f"IF {start} THEN", "    running := TRUE;", f"ELSIF level > {hi - 0.05:g} THEN", "    running := FALSE;",
              "END_IF;", f"running := running AND {' AND '.join(permit)};", "pump := running AND valve;"]
    return "VAR\n" + "\n".join(decls) + "\nEND_VAR\n" + "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# The prompt.

LANGUAGE = ("Language (a Structured Text subset): VAR ... END_VAR declarations (BOOL, INT, REAL, TIME; "
            "function blocks TON, R_TRIG, SR), assignments :=, IF/ELSIF/ELSE/END_IF, AND OR XOR NOT, "
            "= <> < > <= >=, + - * / MOD, ABS SQRT MIN MAX LIMIT(MN, IN, MX) TRUNC, literals like 1.5, TRUE, "
            "T#2s. No loops. Variables declared in VAR keep their values from scan to scan.")


def write_prompt(extra: dict, visible: int, hidden: int) -> str:
    plant, p, spec, dt = extra["plant"], extra["params"], extra["spec"], extra["dt"]
    interface = PLANTS[plant].interface(p)
    lines = [f"Write a PLC program in Structured Text (IEC 61131-3) that {describe_plant(plant, p)}",
             f"The program runs once per scan; the scan period is DT = {dt:g} s.", "",
             "Interface (declared for you; read the inputs, assign the outputs):"]
    for var in interface:
        unit = f" [{var.unit}]" if var.unit else ""
        lines.append(f"  {var.name} : {var.type} ({'input' if var.input else 'output'}){unit}: {var.help}")
    lines += ["", f"Safety (any violation fails): {describe_safety(plant, p)}",
              f"Performance (every scenario): {describe_spec(plant, p, spec)}",
              f"Scenarios: {visible} shown below and {hidden} hidden ones with other "
              f"{'setpoints' if plant != 'pump_valve' else 'demands'}, other event times"
              f"{' and plant parameters within 10%' if plant != 'pump_valve' else ''}:"]
    lines += [f"  - {describe_scenario(plant, s)}" for s in extra["scenarios"][:visible]]
    lines += ["", LANGUAGE, "Answer with the whole program in one ```st code block."]
    return "\n".join(lines)


def describe_plant(plant: str, p: dict) -> str:
    if plant == "tank":
        saturation = (f" The pump saturates: commands above {p['u_max']:g} deliver only {p['u_max']:g} of the rated flow."
                      if p["u_max"] < 1 else "")
        return (f"keeps the level of a tank at its setpoint with a variable-speed pump. Tank: "
                f"A * dh/dt = q * pump - k * sqrt(h) - d, with A = {p['area']:g} m^2, rated flow q = {p['q']:g} m^3/s, "
                f"outflow coefficient k = {p['k']:g} m^2.5/s, d an extra outflow (disturbance).{saturation}"
                + (f" The level sensor has noise (standard deviation {p['noise']:g} m)." if p["noise"] else ""))
    if plant == "thermal":
        saturation = f" The heater saturates at {p['u_max']:g} of full power." if p["u_max"] < 1 else ""
        return (f"holds a heated vessel at its temperature setpoint. Process: first order plus dead time, "
                f"tau * dT/dt = K * heater(t - theta) - (T - T_amb) - d, with K = {p['gain']:g} °C, tau = {p['tau']:g} s, "
                f"dead time theta = {p['dead_time']:g} s, T_amb = {p['ambient']:g} °C, d a heat loss "
                f"(disturbance, in °C).{saturation} The sensor has noise (standard deviation {p['noise']:g} °C).")
    lo, hi = p["band"]
    return (f"keeps the level of a tank between {lo:g} m and {hi:g} m with an on/off pump that fills it through an "
            f"on/off inlet valve, while a consumer draws a changing demand. Tank area {p['area']:g} m^2; the pump "
            f"delivers {p['q']:g} m^3/s, only while the valve is fully open; the valve reports valve_open "
            f"{p['travel']:g} s after it is commanded open and closes at once.")


def describe_safety(plant: str, p: dict) -> str:
    if plant == "tank":
        return f"the level must never exceed {p['h_max']:g} m."
    if plant == "thermal":
        return f"the temperature must never exceed {p['t_max']:g} °C."
    rules = [f"the level must never exceed {p['h_max']:g} m",
             "the pump may run only while valve is TRUE and valve_open is TRUE"]
    if "high_high" in p["rules"]:
        rules.append(f"the pump must be off whenever high_high is TRUE (it trips at {p['high_high']:g} m; "
                     "the level transmitter can fail, the switch cannot)")
    if "min_off" in p["rules"]:
        rules.append(f"after stopping, the pump must stay off for at least {p['min_off']:g} s")
    if "estop" in p["rules"]:
        rules.append("while estop is TRUE, and afterwards until reset is pressed (rising edge) with estop "
                     "released, pump and valve must be FALSE")
    return "; ".join(rules) + "."


def describe_spec(plant: str, p: dict, spec: dict) -> str:
    if plant == "pump_valve":
        lo, hi = p["band"]
        return (f"after the first {spec['fill_time']:g} s, the level stays within {lo - spec['band_tol']:g}-"
                f"{hi + spec['band_tol']:g} m except for at most {spec['outside_s']:g} s (time after a "
                f"transmitter fault or an emergency stop is excused); at most {spec['starts_per_100s']:g} pump starts per 100 s.")
    unit = "m" if plant == "tank" else "°C"
    out = "pump" if plant == "tank" else "heater"
    return (f"overshoot at most {100 * spec['overshoot']:.0f}% of each setpoint step; after each setpoint change "
            f"or disturbance, within ±max({100 * spec['band_frac']:.0f}% of the step, {spec['band_abs']:g} {unit}) "
            f"of the setpoint within {spec['settle']:g} s and staying there; mean |error| over the last "
            f"{spec['ss_window']:g} s before the next event at most {spec['ss_error']:g} {unit}; {out} changes by more "
            f"than 0.5 in one scan at most {spec['jumps']} times.")


def describe_scenario(plant: str, s: dict) -> str:
    if plant == "pump_valve":
        demand = ", ".join(f"{d:g} m^3/s from t = {t:g} s" for t, d in s["demand"])
        text = f"level starts at {s['initial']:g} m; demand {demand}"
        if "stuck" in s:
            text += (f"; the level transmitter sticks at {s['stuck'][2]:g} m from t = {s['stuck'][0]:g} s "
                     f"for {s['stuck'][1]:g} s")
        if "estop" in s:
            text += (f"; emergency stop pressed at t = {s['estop'][0][0]:g} s, released at {s['estop'][1][0]:g} s, "
                     f"reset pressed at {s['reset'][0][0]:g} s")
        return text + f"; runs {s['duration']:g} s."
    unit = "m" if plant == "tank" else "°C"
    quantity = "level" if plant == "tank" else "temperature"
    sps = ", ".join(f"{sp:g} {unit} from t = {t:g} s" for t, sp in s["setpoints"])
    text = f"{quantity} starts at {s['initial']:g} {unit}; setpoint {sps}"
    for t, d in s["disturbances"]:
        text += f"; disturbance d = {d:g} {'m^3/s' if plant == 'tank' else unit} from t = {t:g} s"
    return text + f"; runs {s['duration']:g} s."

