/**
 * The generated types narrow: this file is checked by `tsc --strict` (each `@ts-expect-error` must meet an error,
 * or the build fails), and its functions run on the examples of docs/protocol.md.
 */

import assert from "node:assert/strict";
import { test } from "node:test";

import type { Client, MethodName, Notice, ParamsArgs, Result } from "../src/client.js";
import type { Action, Event, Message, Op, StepResult } from "../src/types.js";

/** What an action asks for, in words: each branch sees only its own member, and the last sees nothing left. */
function describe(op: Op): string {
  if ("Model" in op) return `ask the model with ${op.Model.messages.length} messages`;
  if ("Exec" in op) return `run ${op.Exec.argv.join(" ")}`;
  if ("Read" in op) return `read ${op.Read.path}`;
  if ("Write" in op) return `write ${op.Write.text.length} characters to ${op.Write.path}`;
  if ("Git" in op) return `git ${op.Git.argv.join(" ")}`;
  if ("Browse" in op) return `browse ${op.Browse.url}`;
  if ("Tool" in op) return `call the tool ${op.Tool.name}`;
  if ("Emit" in op) return `say ${JSON.stringify(op.Emit)}`;
  if ("Save" in op) return "nothing (saved)";
  const done: { Done: { turn: number } } = op; // every other kind was taken above
  return `turn ${done.Done.turn} is over`;
}

/** An event's answering id: `Timer` and `Cancel` answer no action. */
function answers(event: Event): number | null {
  if ("Model" in event) return event.Model.id;
  if ("Exec" in event) return event.Exec.id;
  if ("File" in event) return event.File.id;
  if ("Git" in event) return event.Git.id;
  if ("Browse" in event) return event.Browse.id;
  if ("Tool" in event) return event.Tool.id;
  return null;
}

function speaker(message: Message): string {
  if ("User" in message) return "user";
  if ("Agent" in message) return "agent";
  if ("Summary" in message) return "summary";
  const tool: { Tool: { failed?: boolean } } = message;
  return tool.Tool.failed === true ? "tool (failed)" : "tool";
}

/** Notices narrow by method. */
function seq(notice: Notice): string {
  switch (notice.method) {
    case "session/actions":
      return `step ${notice.params.seq}: ${notice.params.actions.length} actions`;
    case "session/unwatched":
      return `unwatched after ${notice.params.seq}: ${notice.params.reason}`;
    case "session/delta":
      return `action ${notice.params.action} writes ${notice.params.text}`;
    case "session/stalled":
      return `action ${notice.params.action} stalled: ${notice.params.why}`;
    case "session/approval":
      return `action ${notice.params.action} waits for approval: ${notice.params.digest}`;
    case "session/decided":
      return `action ${notice.params.action}: ${notice.params.decision} by ${notice.params.by}`;
    case "session/instructions":
      return `action ${notice.params.action} went without ${notice.params.skipped.length} instruction files`;
    case "session/child":
      return `action ${notice.params.action}: child ${notice.params.child} is ${notice.params.state}`;
    case "session/input":
      return `action ${notice.params.action} asks question ${notice.params.request}: ${notice.params.message}`;
    case "session/answered":
      return `question ${notice.params.request} of action ${notice.params.action}: ${notice.params.decision}`;
  }
}

// Type-level checks only: never called.
function typeChecks(op: Op, client: Client): void {
  // @ts-expect-error an Op is not known to ask the model until it is narrowed
  void op.Model;
  // @ts-expect-error a member an Op does not have
  const unknown: Op = { Sleep: 1 };
  // @ts-expect-error the core's optional members are left out, never null
  const nullText: Event = { Model: { id: 1, reply: { text: null } } };
  // @ts-expect-error session/step needs its event
  void client.call("session/step", { session: "x" });
  // @ts-expect-error there is no such method
  void client.call("session/nope", {});
  void client.call("session/list"); // params left out: the method needs none of its members
  void client.call("daemon/status");
  const stepped: Result<"session/step"> extends StepResult ? true : false = true;
  const names: MethodName[] = ["initialize", "session/step", "session/watch"];
  const none: ParamsArgs<"daemon/status"> = [];
  void [unknown, nullText, stepped, names, none];
}
void typeChecks;

test("narrowed with `in`, every kind of action reads as its own member", () => {
  const actions: Action[] = [
    { id: 1, op: { Model: { model: "small", messages: [{ User: "fix the build" }] } } },
    { id: 2, op: { Exec: { argv: ["make"] } } },
    { id: 3, op: { Read: { path: "build.log" } } },
    { id: 4, op: { Write: { path: "main.c", text: "int x;" } } },
    { id: 5, op: { Git: { argv: ["status"] } } },
    { id: 6, op: { Browse: { url: "https://example.com" } } },
    { id: 7, op: { Emit: "x was never declared; declare it." } },
    { id: 8, op: { Save: true } },
    { id: 9, op: { Done: { turn: 1, outcome: { Complete: true } } } },
  ];
  assert.deepEqual(
    actions.map((a) => describe(a.op)),
    [
      "ask the model with 1 messages",
      "run make",
      "read build.log",
      "write 6 characters to main.c",
      "git status",
      "browse https://example.com",
      'say "x was never declared; declare it."',
      "nothing (saved)",
      "turn 1 is over",
    ],
  );
});

test("events narrow to the id of the action they answer", () => {
  const events: Event[] = [
    { Turn: { id: 1, prompt: "fix the build" } },
    { Model: { id: 1, reply: { calls: [{ Exec: { argv: ["make"] } }] } } },
    { Exec: { id: 2, text: "main.c:3: error: x undeclared", failed: true } },
    { File: { id: 3, text: "cc -c main.c" } },
    { Cancel: { turn: 1 } },
    { Timer: true },
  ];
  assert.deepEqual(events.map(answers), [null, 1, 2, 3, null, null]);
});

test("messages and notices narrow too", () => {
  const messages: Message[] = [
    { User: "fix the build" },
    { Agent: { calls: [{ id: 2, call: { Exec: { argv: ["make"] } } }] } },
    { Tool: { id: 2, text: "main.c:3: error: x undeclared", failed: true } },
  ];
  assert.deepEqual(messages.map(speaker), ["user", "agent", "tool (failed)"]);
  const notices: Notice[] = [
    { method: "session/actions", params: { session: "demo", seq: 3, event: { Timer: true }, actions: [], at: "2026-11-30T12:07:18.912Z" } },
    { method: "session/unwatched", params: { session: "demo", seq: 3, reason: "closed" } },
  ];
  assert.deepEqual(notices.map(seq), ["step 3: 0 actions", "unwatched after 3: closed"]);
});
