/**
 * The loop every UI needs: carry out a turn's actions through handlers until the turn is done, whatever a dropped
 * connection or a restarting daemon does meanwhile. The TypeScript twin of devd/driver.py: the same keys, the same
 * default turn ids and the same answers for a missing handler, so either can carry on a turn the other started.
 *
 * `await runTurn(client, session, prompt, handlers)` starts a turn and returns its `Done`, with the actions seen on
 * the way. It promises:
 * - Each action is carried out by the handler of its kind (`Handlers`: model, exec, read, write, git, browse; a
 *   `Tool` action by the handler of its name in `tools`; `emit` for text; `Save` needs nothing), and each result is
 *   reported in a step of its own, in the order the actions came, under the action's id (`Exec` → `Exec`, `Read` and
 *   `Write` → `File`, `Git` → `Git`, `Browse` → `Browse`, `Tool` → `Tool`).
 * - No step runs twice. Each step carries a key derived from the session and what it answers (`turnKey`,
 *   `resultKey`), so a step sent again after a lost connection is answered from the journal (`replayed`) instead.
 * - Nothing that has its result is carried out again. A step answered `replayed` ran before, and the actions its
 *   answer gave may have been carried out since (by this driver before a crash, or by another at work on the same
 *   session), so the work left after it is what the core itself still waits for (`session/pending`), plus the text
 *   and `Done` of that answer; a turn started again under its own id carries on the same way.
 * - `BUSY` is retried with bounded exponential backoff (`Retry`). A lost connection (a daemon restart, say) is
 *   reconnected with the same bounded backoff; the step in flight is sent again under its key, and the work left is
 *   what the core itself still waits for (`session/pending`), plus the text and `Done` of the answer that was lost.
 * - A session in the middle of another turn (a UI that stopped half-way) is carried along: the new turn waits behind
 *   that one in the core, so runTurn carries out the earlier turn's actions too, then its own.
 * - In a fleet, a turn's default id comes from a daemon that holds the session: one that lists it `held: false` (or
 *   not at all) is first asked for it by name, which takes it or follows MOVED to its owner.
 * - A result another driver reported first (`CONFLICT` on its key) is left to that driver, and `resumeTurn` carries
 *   out what a session waits for, whatever the turn.
 *
 * tests/driver_scenarios.json holds the cases both drivers play, with the same expected outcome (a replayed report,
 * a reconnect, a fleet session held false, a crash between a result and its report, named tools).
 *
 * A handler that throws stops the loop with its exception; the session still waits for that action, and the next
 * runTurn (or resumeTurn) on it carries it out.
 */

import { DevdError, isConnectionLost, type Client } from "./client.js";
import type {
  Action,
  Ask,
  Browse,
  Done,
  Event,
  Exec,
  Git,
  Op,
  Read,
  Reply,
  StepResult,
  Write,
} from "./types.js";

/** What a tool handler answers: the text the model will see, and whether the call failed. */
export interface ToolOutput {
  text: string;
  failed?: boolean;
}

/** A tool handler's answer: a string is output that did not fail. */
export type ToolResult = ToolOutput | string;

type Handler<C, R> = (call: C, action: Action) => Promise<R> | R;

/**
 * A named tool's handler: it gets the call's input, parsed (a JSON object: the core dispatches no other), and the
 * action (`action.op.Tool.name` is the name).
 */
export type NamedTool = Handler<Record<string, unknown>, ToolResult>;

/**
 * One function per kind of action, each plain or async. `model` answers the core's ask (the whole conversation) with
 * a reply: text, calls, or both. A tool handler gets the action's op (`Exec`, `Read`, ...) and answers a `ToolOutput`
 * or a string. A kind without a handler is answered as a failed call ("this client cannot browse the web"), so the
 * model learns it and the turn goes on. `tools` holds the handlers of named tools (the model's
 * `{Tool: {name, input}}` calls), by name; a name not there is answered as a failed call ("this client has no tool
 * named N"). `emit` receives text for the user.
 */
export interface Handlers {
  model: Handler<Ask, Reply>;
  exec?: Handler<Exec, ToolResult>;
  read?: Handler<Read, ToolResult>;
  write?: Handler<Write, ToolResult>;
  git?: Handler<Git, ToolResult>;
  browse?: Handler<Browse, ToolResult>;
  tools?: Readonly<Record<string, NamedTool>>;
  emit?: Handler<string, unknown>;
}

/**
 * How long to keep trying: up to `attempts` tries of a call answered `BUSY`, and of each reconnect, waiting
 * `firstDelayMs` after the first, then twice as long each time, up to `maxDelayMs`. The defaults wait about 13 s in
 * all: enough for a daemon to restart.
 */
export interface Retry {
  attempts: number;
  firstDelayMs: number;
  maxDelayMs: number;
}

export const RETRY: Retry = { attempts: 12, firstDelayMs: 50, maxDelayMs: 2000 };

export interface TurnOptions {
  /** The Turn's id (default: the session's last step number plus one; see `nextTurn`). */
  turn?: number;
  retry?: Retry;
}

export interface TurnResult extends Done {
  /** Every action the core answered while the driver ran, in order, the `Done` last. */
  actions: Action[];
}

/** What the driver needs of a client: calls, and a new connection when one is lost. A `Client` is one. */
export type Connection = Pick<Client, "call" | "reconnect">;

/** The turn cannot go on as asked: its id was ignored, or it ended without its `Done` reaching this client. */
export class TurnError extends Error {
  override readonly name = "TurnError";
}

const NAME_CHARS_MAX = 64; // a session name's length limit (devd.protocol.SESSION_NAME_PATTERN)

/**
 * The key of the step that starts turn `turn`. Keys name the session too: a fork inherits its source's keys, and
 * must not take the source's answers for its own.
 */
export function turnKey(session: string, turn: number): string {
  return `devd.driver:${session}:turn:${turn}`;
}

/** The key of the step that reports action `action`'s result (action ids never repeat within a session). */
export function resultKey(session: string, action: number): string {
  return `devd.driver:${session}:result:${action}`;
}

/** The waits between tries, in milliseconds: one fewer than the tries. */
export function delays(retry: Retry): number[] {
  return Array.from({ length: retry.attempts - 1 }, (_, i) => Math.min(retry.firstDelayMs * 2 ** i, retry.maxDelayMs));
}

/**
 * Start a turn of session with prompt, carry out its actions through handlers, and return its `Done`. Throws
 * TurnError when the turn is ignored or ends elsewhere, the `DevdError` of any other refusal, what a handler throws,
 * and the BUSY or connection error once the retries run out.
 */
export async function runTurn(
  client: Connection,
  session: string,
  prompt: string,
  handlers: Handlers,
  options: TurnOptions = {},
): Promise<TurnResult> {
  const retry = options.retry ?? RETRY;
  const turn = options.turn ?? (await nextTurn(client, session, retry));
  const start: Event = { Turn: { id: turn, prompt } };
  const [answer, reconnected] = await step(client, session, start, turnKey(session, turn), retry);
  if (answer.actions.length === 0) {
    throw new TurnError(
      `turn ${turn} was ignored: session '${session}' has had a turn id at least as high; pass a higher turn`,
    );
  }
  if (answer.replayed === true || reconnected) {
    // Started before (by a driver that stopped, or just before the connection went): what the session waits for is
    // the work left, and a session that waits for nothing has no turn running, so this one is over.
    const owed = await pending(client, session, retry);
    if (owed.length === 0) {
      throw new TurnError(`turn ${turn} of session '${session}' ran before and is over; its steps are in the journal`);
    }
    return carryOut(client, session, turn, owed, handlers, retry);
  }
  return carryOut(client, session, turn, answer.actions, handlers, retry);
}

/**
 * Carry out what the session still waits for (`session/pending`) through to the `Done` of its running turn: what a
 * client does after a crash. Null when no turn is running.
 */
export async function resumeTurn(
  client: Connection,
  session: string,
  handlers: Handlers,
  options: Pick<TurnOptions, "retry"> = {},
): Promise<TurnResult | null> {
  const retry = options.retry ?? RETRY;
  const owed = await pending(client, session, retry);
  return owed.length === 0 ? null : carryOut(client, session, null, owed, handlers, retry);
}

/**
 * The session's last step number plus one: each turn takes at least one step, so turns numbered this way always
 * rise (a turn id not above one the session has had is ignored by the core). In a fleet, from a daemon that holds
 * the session: one that does not (it lists the session `held: false`, or not at all when it was made elsewhere since)
 * knows only an old number, so the session is first called by name there (`session/pending`), which takes it or
 * follows MOVED to its owner.
 */
export async function nextTurn(client: Connection, session: string, retry: Retry = RETRY): Promise<number> {
  const params = { limit: 1, cursor: justBefore(session) };
  const listed = async () => (await retried(client, retry, () => client.call("session/list", params)))[0].sessions[0];
  let found = await listed();
  if (found?.session !== session || found.held === false) {
    await pending(client, session, retry); // HANDLE if there is no such session
    found = await listed();
  }
  if (found?.session !== session) {
    const message = `no session is named '${session}'; \`session/list\` shows the sessions there are`;
    throw new DevdError("session/list", { code: -32001, message, data: { kind: "HANDLE" } });
  }
  return found.seq + 1;
}

/**
 * A cursor whose `session/list` page starts at `name`. Pages start after their cursor, and names are at most 64 of
 * A-Z a-z 0-9 . _ - ('z' the greatest), so no name lies between this string and `name`: name with its last
 * character lowered by one, then 'z' up to 64 characters.
 */
function justBefore(name: string): string {
  const last = name.charCodeAt(name.length - 1);
  return name.slice(0, -1) + String.fromCharCode(last - 1) + "z".repeat(NAME_CHARS_MAX - name.length);
}

/** Carry out actions until the `Done` of `turn` (of the running turn, when null). */
async function carryOut(
  client: Connection,
  session: string,
  turn: number | null,
  first: Action[],
  handlers: Handlers,
  retry: Retry,
): Promise<TurnResult> {
  let queue = [...first];
  const seen: Action[] = [];
  let owedBefore = "";
  for (;;) {
    const action = queue.shift();
    if (action === undefined) {
      // Answers ran out before this turn's Done: another client stepped the session (or a turn this one waits
      // behind is owed actions); what the core waits for now is the truth. The same debts twice: no way on.
      const owed = await pending(client, session, retry);
      const ids = owed.map((a) => a.id).join(",");
      if (owed.length === 0 || ids === owedBefore) {
        const which = turn === null ? "its turn" : `turn ${turn}`;
        throw new TurnError(
          `${which} of session '${session}' ended without its Done reaching this client: another client stepped ` +
            "the session (a Cancel, say)",
        );
      }
      owedBefore = ids;
      queue = owed;
      continue;
    }
    seen.push(action);
    const op = action.op;
    if ("Done" in op) {
      if (turn === null || op.Done.turn === turn) return { ...op.Done, actions: seen };
    } else if ("Emit" in op) {
      await handlers.emit?.(op.Emit, action);
    } else if (!("Save" in op)) {
      const event = await carry(op, action, handlers);
      queue = await report(client, session, event, resultKey(session, action.id), queue, retry);
    }
  }
}

/**
 * Step event under key; the work left after it: the queue, then the answer. After a reconnect, the queue is stale
 * (the step may or may not have run before the connection went), and so is a replayed answer's (the step ran before,
 * and its actions may have been carried out since), so the work left is the answer's own text and Done (its asks
 * and calls are waited for, so pending has them), then what the core waits for now. A result some other driver
 * reported first (CONFLICT on its key) is left to it: the queue goes on, and pending catches up.
 */
async function report(
  client: Connection,
  session: string,
  event: Event,
  key: string,
  queue: Action[],
  retry: Retry,
): Promise<Action[]> {
  let answer: StepResult;
  let reconnected: boolean;
  try {
    [answer, reconnected] = await step(client, session, event, key, retry);
  } catch (error) {
    if (error instanceof DevdError && error.kind === "CONFLICT") return queue;
    throw error;
  }
  if (!reconnected && answer.replayed !== true) return [...queue, ...answer.actions];
  return [...answer.actions.filter((a) => !awaited(a.op)), ...(await pending(client, session, retry))];
}

function step(
  client: Connection,
  session: string,
  event: Event,
  key: string,
  retry: Retry,
): Promise<[StepResult, boolean]> {
  return retried(client, retry, () => client.call("session/step", { session, event, key }));
}

async function pending(client: Connection, session: string, retry: Retry): Promise<Action[]> {
  const [result] = await retried(client, retry, () => client.call("session/pending", { session }));
  return result.actions;
}

/** Whether the core waits for this action's result (as opposed to Emit, Save and Done). */
function awaited(op: Op): boolean {
  return !("Emit" in op || "Save" in op || "Done" in op);
}

/** An action that asks the client to do something and report its result. */
type Work = Exclude<Op, { Done: Done } | { Emit: string } | { Save: true }>;

/** Carry out one action through its handler; the event that reports its result. */
async function carry(op: Work, action: Action, handlers: Handlers): Promise<Event> {
  const id = action.id;
  if ("Model" in op) return { Model: { id, reply: await handlers.model(op.Model, action) } };
  if ("Exec" in op) return { Exec: await tool(handlers.exec, op.Exec, action, "this client cannot run commands") };
  if ("Read" in op) return { File: await tool(handlers.read, op.Read, action, "this client cannot read files") };
  if ("Write" in op) return { File: await tool(handlers.write, op.Write, action, "this client cannot write files") };
  if ("Git" in op) return { Git: await tool(handlers.git, op.Git, action, "this client cannot run git") };
  if ("Tool" in op) {
    const { name, input } = op.Tool;
    const missing = `this client has no tool named ${name}`;
    return { Tool: await tool(named(handlers.tools, name), input as Record<string, unknown>, action, missing) };
  }
  return { Browse: await tool(handlers.browse, op.Browse, action, "this client cannot browse the web") };
}

/**
 * The handler of the tool named `name`: an own member of tools only, so that a tool the model calls `constructor` or
 * `toString` is not taken for one of every object's.
 */
function named(tools: Handlers["tools"], name: string): NamedTool | undefined {
  return tools !== undefined && Object.hasOwn(tools, name) ? tools[name] : undefined;
}

/**
 * A call carried out through handler, its result as the core writes one (`failed` only when true); without a
 * handler, a failed result saying `missing` (the model hears of it, and the turn goes on).
 */
async function tool<C>(
  handler: Handler<C, ToolResult> | undefined,
  call: C,
  action: Action,
  missing: string,
): Promise<{ id: number; text: string; failed?: true }> {
  const id = action.id;
  if (handler === undefined) return { id, text: missing, failed: true };
  const result = await handler(call, action);
  if (typeof result === "string") return { id, text: result };
  return result.failed === true ? { id, text: result.text, failed: true } : { id, text: result.text };
}

/**
 * attempt()'s answer, and whether the connection was replaced on the way. BUSY is tried again after each delay; a
 * lost connection is reconnected, at most `attempts` times. Throws the last BUSY error, or the last reconnect's
 * refusal, when the tries run out.
 */
async function retried<T>(client: Connection, retry: Retry, attempt: () => Promise<T>): Promise<[T, boolean]> {
  const busy = delays(retry)[Symbol.iterator]();
  let reconnects = 0;
  for (;;) {
    try {
      return [await attempt(), reconnects > 0];
    } catch (error) {
      if (error instanceof DevdError && error.kind === "BUSY") {
        const delay = busy.next();
        if (delay.done === true) throw error;
        await sleep(delay.value);
      } else if (isConnectionLost(error) && reconnects < retry.attempts) {
        reconnects += 1;
        await reconnectWith(client, retry);
      } else {
        throw error;
      }
    }
  }
}

/** reconnect() until it succeeds, waiting each delay after a refusal; the last refusal is thrown. */
async function reconnectWith(client: Connection, retry: Retry): Promise<void> {
  for (const delay of delays(retry)) {
    try {
      await client.reconnect();
      return;
    } catch (error) {
      if (!isConnectionLost(error)) throw error; // a wrong token, say: no wait will mend it
      await sleep(delay);
    }
  }
  await client.reconnect();
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
