/**
 * The turn driver against a real daemon: the seed's whole turn, its keys, default turn ids, BUSY, a missing handler,
 * named tools, a turn queued behind another, resuming, and a daemon restart in the middle of a turn.
 */

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { connect, ConnectionClosedError, DevdError, type Client } from "../src/client.js";
import {
  delays,
  resultKey,
  resumeTurn,
  runTurn,
  turnKey,
  type Connection,
  type Handlers,
  type Retry,
  type ToolOutput,
} from "../src/driver.js";
import type { Action, Ask, Call, Message, Reply } from "../src/types.js";
import { Daemon } from "./daemon.js";

let daemon: Daemon;
let client: Client;

before(async () => {
  daemon = await Daemon.start();
  client = await connect(daemon.socket);
});

after(async () => {
  await client.close();
  assert.equal(await daemon.remove(), 0, daemon.log.join(""));
});

const QUICK: Retry = { attempts: 4, firstDelayMs: 1, maxDelayMs: 2000 };

// The seed's turn (benchmarks/bench.py, `_seed_turn`): a prompt, an answer with two calls, their results, a text answer.
const BUILD = { Exec: { argv: ["cargo", "build"] } } satisfies Call;
const LIB = { Read: { path: "src/lib.rs" } } satisfies Call;
const PROMPT = "fix the build";
const LOOK = "Let me look.";
const ANSWER = "`x` was never declared.";

/** Handlers that answer as the seed does, and remember what they were asked, in order. */
function seed(): { handlers: Handlers; log: unknown[] } {
  const log: unknown[] = [];
  const replies: Reply[] = [{ text: LOOK, calls: [BUILD, LIB] }, { text: ANSWER }];
  const handlers: Handlers = {
    model: (ask: Ask, action: Action) => {
      log.push(["model", action.id, ask]);
      const reply = replies.shift();
      assert.ok(reply !== undefined, "the model was asked more often than the seed answers");
      return reply;
    },
    exec: async (call, action): Promise<ToolOutput> => {
      log.push(["exec", action.id, call]);
      return { text: "error[E0425]", failed: true };
    },
    read: (call, action) => {
      log.push(["read", action.id, call]);
      return { text: "pub fn f() -> u8 { x }" };
    },
    emit: (text, action) => {
      log.push(["emit", action.id, text]);
    },
  };
  return { handlers, log };
}

/** The conversation the model is asked with, the second time, when the seed's turn started with action `first`. */
function secondAsk(first: number): Message[] {
  return [
    { User: PROMPT },
    { Agent: { text: LOOK, calls: [{ id: first + 1, call: BUILD }, { id: first + 2, call: LIB }] } },
    { Tool: { id: first + 1, text: "error[E0425]", failed: true } },
    { Tool: { id: first + 2, text: "pub fn f() -> u8 { x }" } },
  ];
}

/** Every action of the seed's turn `turn`, when its first action is numbered `first`. */
function seedActions(turn: number, first: number, history: Message[] = []): Action[] {
  return [
    { id: first, op: { Model: { messages: [...history, { User: PROMPT }] } } },
    { id: first + 1, op: { Exec: BUILD.Exec } },
    { id: first + 2, op: { Read: LIB.Read } },
    { id: first + 3, op: { Model: { messages: [...history, ...secondAsk(first)] } } },
    { id: first + 4, op: { Emit: ANSWER } },
    { id: first + 5, op: { Save: true } },
    { id: first + 6, op: { Done: { turn, outcome: { Complete: true } } } },
  ];
}

test("runTurn drives the seed's whole turn to Done, carrying out each action through its handler", async () => {
  await client.call("session/new", { session: "seed" });
  const { handlers, log } = seed();
  const result = await runTurn(client, "seed", PROMPT, handlers, { turn: 1 });
  assert.deepEqual(result, { turn: 1, outcome: { Complete: true }, actions: seedActions(1, 1) });
  assert.deepEqual(log, [
    ["model", 1, { messages: [{ User: PROMPT }] }],
    ["exec", 2, BUILD.Exec],
    ["read", 3, LIB.Read],
    ["model", 4, { messages: secondAsk(1) }],
    ["emit", 5, ANSWER],
  ]);
  assert.deepEqual(
    (await client.call("session/list")).sessions.map((s) => [s.session, s.seq]),
    [["seed", 5]],
  );
});

test("each step's key is derived from the session and what it answers, so sending it again replays it", async () => {
  assert.equal(turnKey("seed", 1), "devd.driver:seed:turn:1");
  assert.equal(resultKey("seed", 2), "devd.driver:seed:result:2");
  const again = await client.call("session/step", {
    session: "seed",
    event: { Exec: { id: 2, text: "error[E0425]", failed: true } },
    key: "devd.driver:seed:result:2",
  });
  assert.deepEqual(again, { actions: [], replayed: true });
  const start = await client.call("session/step", {
    session: "seed",
    event: { Turn: { id: 1, prompt: PROMPT } },
    key: "devd.driver:seed:turn:1",
  });
  assert.deepEqual(start, { actions: [{ id: 1, op: { Model: { messages: [{ User: PROMPT }] } } }], replayed: true });
});

test("a turn without a turn id takes the session's last step plus one, and numbers its actions on", async () => {
  await client.call("session/new", { session: "seed-a" }); // a name sorting just after, which must not be taken
  const { handlers } = seed();
  const result = await runTurn(client, "seed", PROMPT, handlers);
  assert.equal(result.turn, 6); // the first turn took steps 1 to 5
  assert.deepEqual(result.actions, seedActions(6, 8, [...secondAsk(1), { Agent: { text: ANSWER } }]));
  await client.call("session/close", { session: "seed-a" });
});

test("a step refused as BUSY is tried again after each delay until it is answered", async () => {
  assert.deepEqual(delays({ attempts: 5, firstDelayMs: 100, maxDelayMs: 300 }), [100, 200, 300, 300]);
  await client.call("session/new", { session: "busy" });
  let refusals = 2;
  const steps: string[] = [];
  const call = client.call.bind(client) as (method: string, params: unknown) => Promise<unknown>;
  const flaky = {
    call: async (method: string, params: { key?: string }) => {
      if (method === "session/step") {
        steps.push(params.key ?? "");
        if (refusals-- > 0) throw new DevdError(method, { code: -32006, message: "busy", data: { kind: "BUSY" } });
      }
      return call(method, params);
    },
    reconnect: () => assert.fail("nothing should reconnect"),
  } as unknown as Connection;
  const result = await runTurn(flaky, "busy", PROMPT, seed().handlers, { turn: 1, retry: QUICK });
  assert.deepEqual(result.actions, seedActions(1, 1));
  const key = (what: string) => `devd.driver:busy:${what}`;
  assert.deepEqual(steps, [
    ...Array(3).fill(key("turn:1")),
    key("result:1"),
    key("result:2"),
    key("result:3"),
    key("result:4"),
  ]);
});

test("BUSY past the last attempt is thrown", async () => {
  await client.call("session/new", { session: "stuck" });
  let tries = 0;
  const busy = {
    call: async (method: string) => {
      if (method !== "session/step") return { sessions: [{ session: "stuck", seq: 0 }] };
      tries += 1;
      throw new DevdError(method, { code: -32006, message: "busy", data: { kind: "BUSY" } });
    },
    reconnect: () => assert.fail("nothing should reconnect"),
  } as unknown as Connection;
  await assert.rejects(runTurn(busy, "stuck", PROMPT, seed().handlers, { retry: QUICK }), { name: "DevdError" });
  assert.equal(tries, QUICK.attempts);
});

test("a call kind without a handler is answered failed, and the model hears so", async () => {
  await client.call("session/new", { session: "nogit" });
  const asks: Ask[] = [];
  const handlers: Handlers = {
    model: (ask) => {
      asks.push(ask);
      return asks.length === 1 ? { calls: [{ Git: { argv: ["status"] } }] } : { text: "no git, then" };
    },
  };
  const result = await runTurn(client, "nogit", "status?", handlers, { turn: 1 });
  assert.deepEqual(result.outcome, { Complete: true });
  assert.deepEqual(asks[1], {
    messages: [
      { User: "status?" },
      { Agent: { calls: [{ id: 2, call: { Git: { argv: ["status"] } } }] } },
      { Tool: { id: 2, text: "this client cannot run git", failed: true } },
    ],
  });
});

// A reply calling two tools by name: one the tests' handlers know, one they do not (and every object has).
const SEARCH = { Tool: { name: "code.search", input: { q: "x undeclared", in: ["main.c"] } } } satisfies Call;
const UNKNOWN = { Tool: { name: "toString", input: {} } } satisfies Call;

/** A model that calls SEARCH and UNKNOWN, then answers; the asks it was given, in order. */
function searching(): { model: Handlers["model"]; asks: Ask[] } {
  const asks: Ask[] = [];
  const model = (ask: Ask): Reply => {
    asks.push(ask);
    return asks.length === 1 ? { calls: [SEARCH, UNKNOWN] } : { text: "found it" };
  };
  return { model, asks };
}

test("a Tool action is carried out by the handler of its name, given its input parsed", async () => {
  await client.call("session/new", { session: "named" });
  const { model, asks } = searching();
  const given: unknown[] = [];
  const handlers: Handlers = {
    model,
    tools: {
      "code.search": (input, action) => {
        given.push([action.id, input]);
        return "main.c:3: return x;";
      },
      lint: () => assert.fail("no lint was called for"),
    },
  };
  const result = await runTurn(client, "named", "why?", handlers, { turn: 1 });
  assert.deepEqual([result.outcome, given], [{ Complete: true }, [[2, SEARCH.Tool.input]]]);
  assert.deepEqual(asks[1]?.messages.slice(2), [
    { Tool: { id: 2, text: "main.c:3: return x;" } },
    { Tool: { id: 3, text: "this client has no tool named toString", failed: true } },
  ]);
});

test("a named tool's failed output is stepped failed; with no tools, every name is answered failed", async () => {
  await client.call("session/new", { session: "named-failed" });
  const { model, asks } = searching();
  const failing: Handlers = { model, tools: { "code.search": () => ({ text: "index is stale", failed: true }) } };
  await runTurn(client, "named-failed", "why?", failing, { turn: 1 });
  await client.call("session/new", { session: "named-none" });
  const none = searching();
  await runTurn(client, "named-none", "why?", { model: none.model }, { turn: 1 });
  assert.deepEqual(
    [asks[1]?.messages.slice(2), none.asks[1]?.messages.slice(2)],
    [
      [
        { Tool: { id: 2, text: "index is stale", failed: true } },
        { Tool: { id: 3, text: "this client has no tool named toString", failed: true } },
      ],
      [
        { Tool: { id: 2, text: "this client has no tool named code.search", failed: true } },
        { Tool: { id: 3, text: "this client has no tool named toString", failed: true } },
      ],
    ],
  );
});

test("a named tool's handler that throws stops the loop, and the session still waits for its action", async () => {
  await client.call("session/new", { session: "named-throws" });
  const { model } = searching();
  const throwing: Handlers = {
    model,
    tools: {
      "code.search": () => {
        throw new Error("the search service is down");
      },
    },
  };
  await assert.rejects(runTurn(client, "named-throws", "why?", throwing, { turn: 1 }), {
    message: "the search service is down",
  });
  const { actions } = await client.call("session/pending", { session: "named-throws" });
  assert.deepEqual(actions, [
    { id: 2, op: SEARCH },
    { id: 3, op: UNKNOWN },
  ]);
});

test("resumeTurn carries out what a session still waits for, and is null when it waits for nothing", async () => {
  await client.call("session/new", { session: "crashed" });
  // A driver that stopped after the model's first answer: both calls are owed.
  await client.call("session/step", { session: "crashed", event: { Turn: { id: 1, prompt: PROMPT } } });
  await client.call("session/step", {
    session: "crashed",
    event: { Model: { id: 1, reply: { text: LOOK, calls: [BUILD, LIB] } } },
  });
  const { handlers, log } = seed();
  const resumed = await resumeTurn(client, "crashed", { ...handlers, model: () => ({ text: ANSWER }) });
  assert.deepEqual(resumed, { turn: 1, outcome: { Complete: true }, actions: seedActions(1, 1).slice(1) });
  assert.deepEqual(log, [
    ["exec", 2, BUILD.Exec],
    ["read", 3, LIB.Read],
    ["emit", 5, ANSWER],
  ]);
  assert.equal(await resumeTurn(client, "crashed", handlers), null);
});

test("a turn that waits behind another carries the other to its Done first, then its own", async () => {
  await client.call("session/new", { session: "queued" });
  await client.call("session/step", { session: "queued", event: { Turn: { id: 1, prompt: "first" } } });
  const asked: string[] = [];
  const handlers: Handlers = {
    model: (ask) => {
      const last = ask.messages.at(-1);
      asked.push(last !== undefined && "User" in last ? last.User : "?");
      return { text: `done with ${asked.at(-1)}` };
    },
  };
  const result = await runTurn(client, "queued", "second", handlers, { turn: 2 });
  assert.deepEqual(asked, ["first", "second"]);
  assert.deepEqual(result, {
    turn: 2,
    outcome: { Complete: true },
    actions: [
      { id: 2, op: { Save: true } },
      { id: 1, op: { Model: { messages: [{ User: "first" }] } } },
      { id: 3, op: { Emit: "done with first" } },
      { id: 4, op: { Save: true } },
      { id: 5, op: { Done: { turn: 1, outcome: { Complete: true } } } },
      {
        id: 6,
        op: { Model: { messages: [{ User: "first" }, { Agent: { text: "done with first" } }, { User: "second" }] } },
      },
      { id: 7, op: { Emit: "done with second" } },
      { id: 8, op: { Save: true } },
      { id: 9, op: { Done: { turn: 2, outcome: { Complete: true } } } },
    ],
  });
});

test("a turn id not above one the session has had is refused with a TurnError", async () => {
  await assert.rejects(runTurn(client, "seed", "again", seed().handlers, { turn: 5 }), {
    name: "TurnError",
    message: "turn 5 was ignored: session 'seed' has had a turn id at least as high; pass a higher turn",
  });
});

test("running a turn that already ended again says so, and carries nothing out", async () => {
  const { handlers, log } = seed();
  await assert.rejects(runTurn(client, "seed", PROMPT, handlers, { turn: 1 }), {
    name: "TurnError",
    message: "turn 1 of session 'seed' ran before and is over; its steps are in the journal",
  });
  assert.deepEqual(log, []);
});

test("a connection lost for good is thrown once the reconnects run out", async () => {
  let reconnects = 0;
  const gone = {
    call: () => Promise.reject(new ConnectionClosedError("the daemon closed the connection")),
    reconnect: () => {
      reconnects += 1;
      return Promise.reject(Object.assign(new Error("connect ENOENT"), { code: "ENOENT" }));
    },
  } as unknown as Connection;
  await assert.rejects(runTurn(gone, "seed", PROMPT, seed().handlers, { turn: 99, retry: QUICK }), {
    message: "connect ENOENT",
  });
  assert.equal(reconnects, QUICK.attempts);
});

// Last: the daemon restarts, and the shared client's connection with it.
test("a turn outlives a daemon restart in its middle, and each result is stepped once", async () => {
  const own = await connect(daemon.socket);
  try {
    await own.call("session/new", { session: "restarted" });
    const { handlers, log } = seed();
    let restarts = 0;
    const restarting: Handlers = {
      ...handlers,
      // SIGTERM after the first call is carried out, before its result is reported; back 300 ms later.
      exec: async (call, action) => {
        const output = (await handlers.exec?.(call, action)) as ToolOutput;
        if (restarts++ === 0) {
          assert.equal(await daemon.stop(), 0, daemon.log.join(""));
          setTimeout(() => void daemon.launch(), 300);
        }
        return output;
      },
    };
    const result = await runTurn(own, "restarted", PROMPT, restarting, { turn: 1 });
    assert.equal(restarts, 1);
    assert.deepEqual(result, { turn: 1, outcome: { Complete: true }, actions: seedActions(1, 1) });
    assert.deepEqual(
      log.map((entry) => (entry as unknown[])[0]),
      ["model", "exec", "read", "model", "emit"],
    );
    const [info] = (await own.call("session/list", { limit: 1, cursor: "restarteb" })).sessions;
    assert.equal(info?.seq, 5); // the turn, the model's two answers, the two results: each stepped once
  } finally {
    await own.close();
  }
});
