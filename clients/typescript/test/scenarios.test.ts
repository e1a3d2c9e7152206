/**
 * The scenarios both drivers play, from their one home, tests/driver_scenarios.json (its `about` says how they are
 * played; tests/test_driver.py plays them with devd/driver.py): a replayed report, a reconnect, a fleet session held
 * false, a crash between a result and its report, named tools. Each against real daemons of its own; the fleet's
 * store is the PostgreSQL database `$DEVD_TEST_POSTGRES_URL` names (tests/test_typescript.py makes one).
 */

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import { connect } from "../src/client.js";
import {
  resumeTurn,
  runTurn,
  TurnError,
  type Handlers,
  type NamedTool,
  type Retry,
  type ToolOutput,
  type TurnResult,
} from "../src/driver.js";
import type { Action, Ask, Done, Event, Reply } from "../src/types.js";
import { Daemon, ROOT } from "./daemon.js";

type Ended = Done | "crash" | "TurnError" | null;

interface Run {
  driver: string;
  call: "run_turn" | "resume_turn";
  via?: "a" | "b";
  prompt?: string;
  turn?: number;
  at?: Record<string, Run | "crash">;
  ends: Ended;
}

/** A step of the session as `session/watch` gives it. */
interface Step {
  event: Event;
  actions: Action[];
}

interface Scenario {
  name: string;
  session: string;
  model?: string;
  failpoints?: string;
  fleet?: boolean;
  runs: Run[];
  carried: [string, string, number][];
  restarts?: number;
  seq: number;
  journal?: Step[];
}

interface Scenarios {
  models: Record<string, Reply[]>;
  exec: ToolOutput;
  read: ToolOutput;
  tools: Record<string, { input: Record<string, unknown>; answer: ToolOutput }>;
  scenarios: Scenario[];
}

const SCENARIOS = JSON.parse(readFileSync(join(ROOT, "tests", "driver_scenarios.json"), "utf8")) as Scenarios;
const PATIENT: Retry = { attempts: 30, firstDelayMs: 50, maxDelayMs: 1000 }; // a daemon back within about 25 s
const LEASE_TTL_S = "1.5"; // as tests/test_fleet.py's daemons

/** What a handler throws to stand for its driver dying there. */
class Crash extends Error {}

/** One scenario on its daemons: what the drivers carried out, and how each driver call ended, in that order. */
class Played {
  readonly carried: [string, string, number][] = [];
  readonly ended: [string, Ended][] = [];

  constructor(
    readonly session: string,
    readonly replies: Reply[],
    readonly daemons: { a: Daemon; b?: Daemon },
  ) {}

  /** Make one driver call on a connection of its own, and note how it ended. */
  async run(spec: Run): Promise<void> {
    const daemon = this.daemons[spec.via ?? "a"];
    assert.ok(daemon !== undefined, `scenario run ${spec.driver} goes through a daemon this scenario has not`);
    const client = await connect(daemon.socket);
    const handlers = this.handlers(spec.driver, spec.at ?? {});
    let ended: Ended;
    try {
      let result: TurnResult | null;
      if (spec.call === "run_turn") {
        const options = spec.turn === undefined ? { retry: PATIENT } : { turn: spec.turn, retry: PATIENT };
        result = await runTurn(client, this.session, spec.prompt ?? "", handlers, options);
      } else {
        result = await resumeTurn(client, this.session, handlers, { retry: PATIENT });
      }
      ended = result === null ? null : { turn: result.turn, outcome: result.outcome };
    } catch (error) {
      if (error instanceof Crash) ended = "crash";
      else if (error instanceof TurnError) ended = "TurnError";
      else throw error;
    } finally {
      await client.close();
    }
    this.ended.push([spec.driver, ended]);
  }

  /** Handlers that answer as the file says, note what they carry out, and meet the hooks of `at`. */
  handlers(driver: string, at: Record<string, Run | "crash">): Handlers {
    const hook = async (point: string): Promise<void> => {
      const what = at[point];
      if (what === "crash") throw new Crash(`${driver} dies at ${point}`);
      if (what !== undefined) await this.run(what);
    };
    const carry = async (kind: string, action: Action): Promise<void> => {
      await hook(`before ${action.id}`);
      this.carried.push([driver, kind, action.id]);
      await hook(`after ${action.id}`);
    };
    return {
      model: async (ask: Ask, action) => {
        let lastUser = 0;
        ask.messages.forEach((m, i) => {
          if ("User" in m) lastUser = i;
        });
        await carry("model", action);
        const reply = this.replies[ask.messages.slice(lastUser).filter((m) => "Agent" in m).length];
        assert.ok(reply !== undefined, "the model was asked more often than the scenarios' model answers");
        return reply;
      },
      exec: async (_call, action) => {
        await carry("exec", action);
        return SCENARIOS.exec;
      },
      read: async (_call, action) => {
        await carry("read", action);
        return SCENARIOS.read;
      },
      emit: async (_text, action) => {
        await carry("emit", action);
      },
      tools: Object.fromEntries(
        Object.entries(SCENARIOS.tools).map(([name, said]): [string, NamedTool] => [
          name,
          async (input, action) => {
            assert.deepEqual(input, said.input, `the handler of ${name} was given ${JSON.stringify(input)}`);
            await carry(`tool ${name}`, action);
            return said.answer;
          },
        ]),
      ),
    };
  }
}

/** The first `steps` steps of session as `session/watch` from 0 gives them: each one's event and actions. */
async function watched(daemon: Daemon, session: string, steps: number): Promise<Step[]> {
  const client = await connect(daemon.socket);
  const seen: Step[] = [];
  try {
    for await (const notice of client.watch(session, { since: 0 })) {
      if (notice.method !== "session/actions") break;
      seen.push({ event: notice.params.event, actions: notice.params.actions });
      if (seen.length === steps) break;
    }
  } finally {
    await client.close();
  }
  return seen;
}

/** How each driver call of runs should end, in the order they end: a call made in a hook before its caller. */
function ends(runs: Run[]): [string, Ended][] {
  return runs.flatMap((run) => [
    ...ends(Object.values(run.at ?? {}).filter((hooked): hooked is Run => hooked !== "crash")),
    [run.driver, run.ends] as [string, Ended],
  ]);
}

async function play(scenario: Scenario): Promise<void> {
  const url = process.env.DEVD_TEST_POSTGRES_URL;
  if (scenario.fleet === true && url === undefined) {
    assert.fail(
      `scenario "${scenario.name}" needs a PostgreSQL database for its fleet: set DEVD_TEST_POSTGRES_URL ` +
        "(tests/test_typescript.py makes one for each run)",
    );
  }
  const fleet = (node: string): string[] =>
    scenario.fleet === true ? ["--store", url ?? "", "--node", node, "--lease-ttl", LEASE_TTL_S] : [];
  const failpoints = scenario.failpoints;
  const armed = failpoints === undefined ? {} : { DEVD_FAILPOINTS: failpoints };
  const a = await Daemon.start({ args: fleet("a"), env: armed });
  let b: Daemon | undefined;
  let restarts = 0;
  let stopping = false;
  // The daemon armed with failpoints, started again without them each time one kills it.
  const supervisor = (async () => {
    while (failpoints !== undefined) {
      const { signal } = await a.exit();
      if (stopping || signal !== "SIGKILL") return;
      restarts += 1;
      a.env = {};
      await a.launch();
    }
  })();
  let played: Played;
  let seq: number;
  let steps: Step[] | undefined;
  try {
    const client = await connect(a.socket);
    await client.call("session/new", { session: scenario.session });
    await client.close();
    if (scenario.fleet === true) b = await Daemon.start({ args: fleet("b") }); // it lists the session held: false
    const replies = SCENARIOS.models[scenario.model ?? "build"];
    assert.ok(replies !== undefined, `scenario "${scenario.name}" names a model the file has not`);
    played = new Played(scenario.session, replies, b === undefined ? { a } : { a, b });
    for (const run of scenario.runs) await played.run(run);
    const after = await connect(a.socket);
    seq = (await after.call("session/info", { session: scenario.session })).seq;
    await after.close();
    if (scenario.journal !== undefined) steps = await watched(a, scenario.session, seq);
  } finally {
    stopping = true;
    await b?.remove();
    await a.remove();
    await supervisor;
  }
  assert.deepEqual(
    { ended: played.ended, carried: played.carried, restarts, seq, steps },
    {
      ended: ends(scenario.runs),
      carried: scenario.carried,
      restarts: scenario.restarts ?? 0,
      seq: scenario.seq,
      steps: scenario.journal,
    },
  );
}

// One test per scenario of the file (tests/test_typescript.py counts them as declared tests).
for (const scenario of SCENARIOS.scenarios) {
  test(`the shared scenario "${scenario.name}" carries out each action as written`, () => play(scenario));
}
