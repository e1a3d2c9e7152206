/** The client against a real daemon: typed calls, errors with their kind, TCP with the token, watch, close. */

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import {
  connect,
  ConnectionClosedError,
  DevdError,
  FellBehindError,
  isConnectionLost,
  type Client,
  type Notice,
} from "../src/client.js";
import type { Action, Event } from "../src/types.js";
import { Daemon } from "./daemon.js";

let daemon: Daemon;

before(async () => {
  daemon = await Daemon.start({ tcp: true });
});

after(async () => {
  assert.equal(await daemon.remove(), 0, daemon.log.join(""));
});

async function withClient<T>(body: (client: Client) => Promise<T>): Promise<T> {
  const client = await connect(daemon.socket);
  try {
    return await body(client);
  } finally {
    await client.close();
  }
}

async function rejection(promise: Promise<unknown>): Promise<unknown> {
  try {
    await promise;
  } catch (error) {
    return error;
  }
  assert.fail("the promise resolved");
}

test("connecting says hello and keeps what the daemon answered", async () => {
  await withClient(async (client) => {
    assert.equal(client.hello?.protocol, 1);
    assert.equal(client.hello?.server.name, "devd");
    assert.equal(client.hello?.limits.call_timeout_ms, 5000);
  });
});

test("calls answer the method's result", async () => {
  await withClient(async (client) => {
    assert.deepEqual(await client.call("session/new", { session: "calls", config: { model: "small" } }), {
      session: "calls",
    });
    const stepped = await client.call("session/step", {
      session: "calls",
      event: { Turn: { id: 1, prompt: "fix the build" } },
    });
    assert.deepEqual(stepped, {
      actions: [{ id: 1, op: { Model: { model: "small", messages: [{ User: "fix the build" }] } } }],
    });
    assert.deepEqual(await client.call("session/pending", { session: "calls" }), stepped);
    const listed = await client.call("session/list");
    assert.deepEqual(
      listed.sessions.map((s) => [s.session, s.state, s.seq]),
      [["calls", "live", 1]],
    );
    assert.deepEqual(await client.call("session/close", { session: "calls" }), {});
  });
});

test("a Tool action arrives with its input as an object, and a Tool event answers it", async () => {
  await withClient(async (client) => {
    await client.call("session/new", { session: "tool" });
    await client.call("session/step", { session: "tool", event: { Turn: { id: 1, prompt: "find x" } } });
    const search = { name: "search", input: { q: ["x", 1], deep: { ok: true } } };
    const answer: Event = { Model: { id: 1, reply: { calls: [{ Tool: search }] } } };
    const dispatched = await client.call("session/step", { session: "tool", event: answer });
    const result: Event = { Tool: { id: 2, text: "no hits", failed: true } };
    const stepped = await client.call("session/step", { session: "tool", event: result });
    const { messages } = await client.call("session/transcript", { session: "tool" });
    await client.call("session/close", { session: "tool" });
    assert.deepEqual(
      [dispatched, stepped.ignored, messages.at(-1)],
      [{ actions: [{ id: 2, op: { Tool: search } }] }, undefined, { Tool: { id: 2, text: "no hits", failed: true } }],
    );
  });
});

test("many calls in flight on one connection each get their own answer", async () => {
  await withClient(async (client) => {
    const names = Array.from({ length: 20 }, (_, i) => `flight-${i}`);
    const made = await Promise.all(names.map((session) => client.call("session/new", { session })));
    assert.deepEqual(
      made.map((r) => r.session),
      names,
    );
    await Promise.all(names.map((session) => client.call("session/close", { session })));
  });
});

test("an error reply rejects with a DevdError carrying its kind and code", async () => {
  await withClient(async (client) => {
    const missing = await rejection(client.call("session/snapshot", { session: "nobody" }));
    assert.ok(missing instanceof DevdError);
    assert.equal(missing.kind, "HANDLE");
    assert.equal(missing.code, -32001);
    assert.equal(missing.method, "session/snapshot");
    assert.match(missing.message, /^session\/snapshot: HANDLE: no session is named 'nobody'/);

    const badName = await rejection(client.call("session/new", { session: "no/slashes" }));
    assert.ok(badName instanceof DevdError);
    assert.equal(badName.kind, "INVALID_PARAMS");
    assert.equal(badName.code, -32602);
  });
});

test("over TCP the token is presented first, and a wrong one is refused as UNAUTHORIZED", async () => {
  assert.ok(daemon.tcp !== undefined);
  const client = await connect(daemon.tcp, { token: await daemon.token() });
  try {
    assert.deepEqual(await client.call("session/list", { limit: 10 }), { sessions: [] });
  } finally {
    await client.close();
  }
  const refused = await rejection(connect(daemon.tcp, { token: "x".repeat(40) }));
  assert.ok(refused instanceof DevdError);
  assert.equal(refused.kind, "UNAUTHORIZED");
});

test("watch yields every step after since, then the unwatched notice, and ends", async () => {
  await withClient(async (client) => {
    await client.call("session/new", { session: "watched" });
    const events: Event[] = [
      { Turn: { id: 1, prompt: "fix the build" } },
      { Model: { id: 1, reply: { calls: [{ Exec: { argv: ["make"] } }] } } },
    ];
    const answered: Action[][] = [];
    for (const event of events) {
      answered.push((await client.call("session/step", { session: "watched", event })).actions);
    }

    await withClient(async (watcher) => {
      const notices: Notice[] = [];
      const watching = (async () => {
        for await (const notice of watcher.watch("watched", { since: 0 })) notices.push(notice);
      })();
      await waitFor(() => notices.length === 2);
      await client.call("session/close", { session: "watched" });
      await watching;
      const at = notices.map((n) => (n.method === "session/actions" ? n.params.at : ""));
      assert.ok(at.slice(0, 2).every((t) => /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/.test(t)), at.join());
      assert.deepEqual(notices, [
        {
          method: "session/actions",
          params: { session: "watched", seq: 1, event: events[0], actions: answered[0], at: at[0] },
        },
        {
          method: "session/actions",
          params: { session: "watched", seq: 2, event: events[1], actions: answered[1], at: at[1] },
        },
        { method: "session/unwatched", params: { session: "watched", seq: 2, reason: "closed" } },
      ]);
    });
  });
});

test("breaking out of a watch unwatches the session", async () => {
  await withClient(async (client) => {
    await client.call("session/new", { session: "left" });
    await client.call("session/step", { session: "left", event: { Turn: { id: 1, prompt: "x" } } });
    for await (const notice of client.watch("left", { since: 0 })) {
      assert.equal(notice.method, "session/actions");
      break;
    }
    const [info] = (await client.call("session/list")).sessions.filter((s) => s.session === "left");
    assert.equal(info?.watchers, undefined); // none: the daemon leaves out a count of 0
    await client.call("session/close", { session: "left" });
  });
});

test("a watch the daemon refuses throws its error from the loop", async () => {
  await withClient(async (client) => {
    const refused = await rejection((async () => {
      for await (const _ of client.watch("nobody")) assert.fail("a notice for a session that is not there");
    })());
    assert.ok(refused instanceof DevdError);
    assert.equal(refused.kind, "HANDLE");
  });
});

test("a watch that falls behind throws FellBehindError after what it holds, naming the step to watch again from", async () => {
  await withClient(async (client) => {
    await client.call("session/new", { session: "slow" });
    for (let id = 1; id <= 4; id++) {
      await client.call("session/step", { session: "slow", event: { Cancel: { turn: id } } });
    }
  });
  const slow = await connect(daemon.socket, { noticesMax: 2 });
  try {
    const seen: number[] = [];
    const watch = slow.watch("slow", { since: 0 });
    await watch.started; // the journal's four steps have come, and are held for a consumer that has not pulled
    const behind = await rejection((async () => {
      for await (const notice of watch) if (notice.method === "session/actions") seen.push(notice.params.seq);
    })());
    assert.deepEqual(seen, [1, 2]);
    assert.ok(behind instanceof FellBehindError);
    assert.equal(behind.seq, 2);
    for await (const notice of slow.watch("slow", { since: behind.seq })) {
      if (notice.method !== "session/actions") continue;
      seen.push(notice.params.seq);
      if (notice.params.seq === 4) break;
    }
    assert.deepEqual(seen, [1, 2, 3, 4]);
    await slow.call("session/close", { session: "slow" });
  } finally {
    await slow.close();
  }
});

test("a request longer than the daemon's line limit is refused as TOO_LARGE without being sent", async () => {
  await withClient(async (client) => {
    const limit = client.hello?.limits.line_bytes_max ?? 0;
    const large = await rejection(client.call("session/new", { session: "x".repeat(limit) }));
    assert.ok(large instanceof DevdError);
    assert.equal(large.kind, "TOO_LARGE");
    assert.deepEqual(await client.call("session/list"), { sessions: [] }); // the connection is still in step
  });
});

test("a call after close rejects with ConnectionClosedError", async () => {
  const client = await connect(daemon.socket);
  await client.close();
  assert.ok((await rejection(client.call("session/list"))) instanceof ConnectionClosedError);
});

// Last: the daemon restarts.
test("after a daemon restart, calls and watches reject as the connection lost, and reconnect() makes a new one", async () => {
  const client = await connect(daemon.socket);
  try {
    await client.call("session/new", { session: "durable" });
    const watching = rejection((async () => {
      for await (const _ of client.watch("durable")) assert.fail("no step was made");
    })());
    assert.equal(await daemon.stop(), 0, daemon.log.join(""));
    assert.ok((await watching) instanceof ConnectionClosedError);
    const lost = await rejection(client.call("session/list"));
    assert.ok(lost instanceof ConnectionClosedError);
    assert.ok(isConnectionLost(await rejection(client.reconnect())));
    await daemon.launch();
    await client.reconnect();
    assert.deepEqual(
      (await client.call("session/list")).sessions.map((s) => [s.session, s.state]),
      [["durable", "stored"]],
    );
    await client.call("session/close", { session: "durable" });
  } finally {
    await client.close();
  }
});

async function waitFor(condition: () => boolean, timeoutMs = 10_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!condition()) {
    if (Date.now() > deadline) assert.fail(`not so within ${timeoutMs} ms`);
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
}
