/**
 * A client of devd: newline-delimited JSON-RPC 2.0 over a Unix socket or TCP, with Node's built-ins only.
 *
 * What it promises:
 * - `call(method, params)` is typed by the generated `Methods` map: the params a method takes, the result it answers.
 * - Many calls may be in flight on one connection; replies are matched by id, whatever order they come in.
 * - An error reply rejects with a `DevdError` carrying the protocol's `kind` and `code`; a connection that ends
 *   rejects every call still waiting with `ConnectionClosedError`. Nothing is retried here: the turn driver decides.
 * - `watch(session, {since})` is an async iterator of the session's notices, ended by `session/unwatched`, by
 *   `break` (which unwatches) or by `close()`. A lost connection throws `ConnectionClosedError` from the loop, and a
 *   consumer that falls `noticesMax` notices behind gets `FellBehindError`, each after the notices already received,
 *   and each naming the last step given out, to watch again from.
 * - A request longer than the daemon's `line_bytes_max` is refused here (`TOO_LARGE`), not sent: the daemon would
 *   answer it with id null, which no call could be matched to.
 * - Over TCP, the first call is `initialize` with the token, as docs/protocol.md requires; on the Unix socket the
 *   client refuses a socket file that belongs to another user (the daemon's peer check, seen from the client).
 * - `reconnect()` opens a new connection to the same address (after a daemon restart, say); what was waiting on the
 *   old one has already been rejected, and its watches ended.
 */

import { lstatSync } from "node:fs";
import { createConnection, type Socket } from "node:net";

import type {
  Error as ErrorObject,
  ErrorKind,
  InitializeResult,
  Methods,
  Notifications,
  Protocol,
} from "./types.js";

/** The protocol this client speaks; `connect` refuses a daemon that answers another. */
export const PROTOCOL: Protocol = 1;
const VERSION = "0.1.0";
const NEWLINE = 0x0a;

export type MethodName = keyof Methods;
export type Params<M extends MethodName> = Methods[M]["params"];
export type Result<M extends MethodName> = Methods[M]["result"];
/** A method's params may be left out when it needs none of its members. */
export type ParamsArgs<M extends MethodName> = Record<string, never> extends Params<M>
  ? [params?: Params<M>]
  : [params: Params<M>];

/** A notification the daemon sends, narrowed by `method`. */
export type Notice = {
  [N in keyof Notifications]: { method: N; params: Notifications[N] };
}[keyof Notifications];

export interface ConnectOptions {
  /** The token from the daemon's state directory (file `token`): required over TCP. */
  token?: string;
  /** Who is calling, for the daemon's log. */
  client?: { name: string; version?: string };
  /** The longest line accepted from the daemon, in bytes; a longer one closes the connection. */
  lineBytesMax?: number;
  /** How many notices a watch may hold for a consumer that is slower than the daemon. */
  noticesMax?: number;
}

/** A watch's notices, and when the daemon has answered it. */
export interface WatchIterator extends AsyncIterableIterator<Notice> {
  /**
   * Settles once the daemon has answered `session/watch`: every step after `since` already in the journal has then
   * been received. It never rejects; a refused watch throws from the loop.
   */
  readonly started: Promise<void>;
}

export interface WatchOptions {
  /** Start after this step, sending the steps already in the journal first (default: from now on). */
  since?: number;
}

/** An error reply from the daemon: branch on `kind`; `message` says what to do next. */
export class DevdError extends Error {
  override readonly name = "DevdError";
  readonly kind: ErrorKind;
  readonly code: number;
  readonly method: string;

  constructor(method: string, error: ErrorObject) {
    super(`${method}: ${error.data.kind}: ${error.message}`);
    this.kind = error.data.kind;
    this.code = error.code;
    this.method = method;
  }
}

/** The connection ended before the answer came: whether the call was carried out is unknown (retry with a key). */
export class ConnectionClosedError extends Error {
  override readonly name = "ConnectionClosedError";
}

/** A watch fell too far behind: watch again with `since: seq` to carry on from the journal, with no gap. */
export class FellBehindError extends Error {
  override readonly name = "FellBehindError";

  constructor(
    readonly session: string,
    readonly seq: number,
    reason: string,
  ) {
    super(`the watch of ${session} ended after step ${seq}: ${reason}; watch again with since: ${seq}`);
  }
}

interface Waiting {
  method: string;
  resolve: (result: unknown) => void;
  reject: (error: Error) => void;
}

interface Reply {
  id?: number | string | null;
  result?: unknown;
  error?: ErrorObject;
  method?: string;
  params?: unknown;
}

/** Connect to the daemon at a Unix socket path or `tcp://HOST:PORT`, and say hello (with the token over TCP). */
export async function connect(address: string, options: ConnectOptions = {}): Promise<Client> {
  const client = new Client(address, options);
  await client.reconnect();
  return client;
}

/** Whether an error means the connection is gone or the daemon is not (yet) there: worth a reconnect. */
export function isConnectionLost(error: unknown): boolean {
  if (error instanceof ConnectionClosedError) return true;
  const code = (error as NodeJS.ErrnoException | null)?.code;
  return code !== undefined && LOST.has(code);
}

const LOST = new Set(["ECONNREFUSED", "ENOENT", "ECONNRESET", "EPIPE", "ECONNABORTED"]);

function parseTcp(address: string): { host: string; port: number } | null {
  if (!address.startsWith("tcp://")) return null;
  const rest = address.slice("tcp://".length);
  const colon = rest.lastIndexOf(":");
  const port = Number(rest.slice(colon + 1));
  if (colon <= 0 || !Number.isInteger(port) || port <= 0 || port > 65535) {
    throw new Error(`${address} is not tcp://HOST:PORT`);
  }
  return { host: rest.slice(0, colon).replace(/^\[(.*)\]$/, "$1"), port };
}

/**
 * Refuse a socket file another user made. Node cannot ask the kernel who serves a socket (SO_PEERCRED), so this
 * checks the file's owner, which is whoever bound it: a stranger who got to the socket's directory first could
 * otherwise stand in for the daemon and hand us its actions (Exec included).
 */
function checkSocketOwner(path: string): void {
  const uid = process.getuid?.();
  if (uid === undefined) return;
  const owner = lstatSync(path, { throwIfNoEntry: false })?.uid;
  if (owner !== undefined && owner !== uid && owner !== 0) {
    throw new Error(
      `the socket ${path} belongs to uid ${owner}, not to this user (uid ${uid}) or root, so it is not your daemon; ` +
        "nothing was sent",
    );
  }
}

function open(target: { path: string } | { host: string; port: number }): Promise<Socket> {
  return new Promise((resolve, reject) => {
    const socket = createConnection(target);
    socket.once("connect", () => {
      socket.off("error", reject);
      resolve(socket);
    });
    socket.once("error", reject);
  });
}

/** A connection to the daemon. Made by `connect`. */
export class Client {
  /** What the daemon answered to `initialize`: its version, protocol and limits. */
  hello: InitializeResult | undefined;
  private socket: Socket | null = null;
  private readonly waiting = new Map<number, Waiting>();
  private readonly watches = new Map<string, Watch>();
  private readonly lineBytesMax: number;
  private readonly noticesMax: number;
  private chunks: Buffer[] = [];
  private buffered = 0;
  private nextId = 1;
  private closed: Error | null = new ConnectionClosedError("not connected yet");
  private ended: Promise<void> = Promise.resolve();

  constructor(
    readonly address: string,
    private readonly options: ConnectOptions = {},
  ) {
    this.lineBytesMax = options.lineBytesMax ?? 64 * 1024 * 1024;
    this.noticesMax = options.noticesMax ?? 10_000;
  }

  /**
   * Open a connection to the address, and say hello. Rejects with the socket's error when the daemon is not there
   * (`isConnectionLost` tells), with a `DevdError` when it refuses the hello (a wrong token).
   */
  async reconnect(): Promise<void> {
    this.drop(new ConnectionClosedError("the client reconnected"));
    const tcp = parseTcp(this.address);
    if (tcp === null) checkSocketOwner(this.address);
    const socket = await open(tcp ?? { path: this.address });
    this.attach(socket);
    try {
      const hello = await this.call("initialize", {
        client: this.options.client ?? { name: "devd-client", version: VERSION },
        ...(this.options.token === undefined ? {} : { token: this.options.token }),
      });
      if (hello.protocol !== PROTOCOL) {
        const speaks = `speaks protocol ${hello.protocol}; this client speaks ${PROTOCOL}`;
        throw new Error(`the daemon at ${this.address} ${speaks}`);
      }
      this.hello = hello;
    } catch (error) {
      await this.close();
      throw error;
    }
  }

  private attach(socket: Socket): void {
    this.socket = socket;
    this.closed = null;
    this.chunks = [];
    this.buffered = 0;
    this.ended = new Promise((resolve) => socket.once("close", () => resolve()));
    // Events of a socket this client has since replaced are nothing to it.
    const current = () => this.socket === socket;
    socket.on("data", (data: Buffer) => current() && this.receive(data));
    socket.on("error", (error) => current() && this.end(lost(`the connection failed: ${error.message}`)));
    socket.on("close", () => current() && this.end(lost("the daemon closed the connection")));
  }

  /** Call a method; resolves with its result, or rejects with the `DevdError` the daemon answered. */
  call<M extends MethodName>(method: M, ...[params]: ParamsArgs<M>): Promise<Result<M>> {
    const socket = this.socket;
    if (this.closed !== null || socket === null) return Promise.reject(this.closed);
    const id = this.nextId++;
    const line = JSON.stringify({ jsonrpc: "2.0", id, method, params: params ?? {} }) + "\n";
    const lineBytesMax = this.hello?.limits.line_bytes_max;
    if (lineBytesMax !== undefined && Buffer.byteLength(line) - 1 > lineBytesMax) {
      const message = `the request is longer than the daemon's ${lineBytesMax} bytes; it was not sent`;
      return Promise.reject(new DevdError(method, { code: -32009, message, data: { kind: "TOO_LARGE" } }));
    }
    return new Promise<Result<M>>((resolve, reject) => {
      this.waiting.set(id, { method, resolve: resolve as (result: unknown) => void, reject });
      socket.write(line);
    });
  }

  /**
   * The session's notices: every step after `since` (or from now), each as it was answered, then the
   * `session/unwatched` that ends the watch. Breaking out of the loop unwatches.
   */
  watch(session: string, options: WatchOptions = {}): WatchIterator {
    if (this.watches.has(session)) throw new Error(`this connection already watches ${session}`);
    const params = options.since === undefined ? { session } : { session, since: options.since };
    const watch = new Watch(session, options.since, this.noticesMax, () => this.unwatch(session));
    this.watches.set(session, watch); // before the call: the journal's steps come before its answer
    watch.started = this.call("session/watch", params).then(
      () => undefined,
      (error: Error) => {
        this.watches.delete(session);
        watch.fail(error);
      },
    );
    return watch;
  }

  /** Close the connection; calls still waiting reject with `ConnectionClosedError`. */
  async close(): Promise<void> {
    this.end(new ConnectionClosedError("the client closed the connection"));
    this.socket?.end(); // what was written is still sent; the daemon then closes its side
    await this.ended;
  }

  /** End the current connection, if any, rejecting what waits on it with reason. */
  private drop(reason: Error): void {
    this.end(reason);
    this.socket?.destroy();
  }

  private async unwatch(session: string): Promise<void> {
    this.watches.delete(session);
    if (this.closed === null) await this.call("session/unwatch", { session });
  }

  private receive(data: Buffer): void {
    let start = 0;
    for (let end = data.indexOf(NEWLINE); end >= 0; end = data.indexOf(NEWLINE, start)) {
      this.chunks.push(data.subarray(start, end));
      const line = Buffer.concat(this.chunks).toString("utf8");
      this.chunks = [];
      this.buffered = 0;
      start = end + 1;
      this.dispatch(line);
    }
    if (start < data.length) {
      this.chunks.push(data.subarray(start));
      this.buffered += data.length - start;
      if (this.buffered > this.lineBytesMax) {
        this.drop(lost(`the daemon sent a line longer than ${this.lineBytesMax} bytes`));
      }
    }
  }

  private dispatch(line: string): void {
    let reply: Reply;
    try {
      reply = JSON.parse(line) as Reply;
    } catch {
      this.drop(lost(`the daemon sent a line that is not JSON: ${line.slice(0, 80)}`));
      return;
    }
    if (reply.method !== undefined) {
      this.notice({ method: reply.method, params: reply.params } as Notice);
      return;
    }
    if (typeof reply.id !== "number") return; // an error about a line we never sent as a request
    const waiting = this.waiting.get(reply.id);
    if (waiting === undefined) return;
    this.waiting.delete(reply.id);
    if (reply.error !== undefined) waiting.reject(new DevdError(waiting.method, reply.error));
    else waiting.resolve(reply.result);
  }

  private notice(notice: Notice): void {
    const watch = this.watches.get(notice.params.session);
    if (watch === undefined) return; // unwatched meanwhile: the daemon stops once it has our unwatch
    if (notice.method === "session/unwatched") this.watches.delete(notice.params.session);
    watch.push(notice);
  }

  /** The connection is over: calls waiting reject with reason; watches end, quietly only if this client closed. */
  private end(reason: Error): void {
    if (this.closed !== null) return;
    this.closed = reason;
    for (const waiting of this.waiting.values()) waiting.reject(reason);
    this.waiting.clear();
    for (const watch of this.watches.values()) {
      if (reason instanceof ConnectionLostError) watch.fail(reason);
      else watch.finish();
    }
    this.watches.clear();
  }
}

/** The connection ended without this client closing it. */
class ConnectionLostError extends ConnectionClosedError {}

function lost(why: string): ConnectionLostError {
  return new ConnectionLostError(why);
}

/** One session's notices, queued for a consumer that pulls them with `for await`. */
class Watch implements WatchIterator {
  private readonly queue: Notice[] = [];
  private readonly pulls: Array<{ resolve: (r: IteratorResult<Notice>) => void; reject: (e: Error) => void }> = [];
  private ended = false; // no notice will be pushed any more: the queue is all there is
  private error: Error | null = null; // thrown once the queue is given out
  started: Promise<void> = Promise.resolve();

  constructor(
    private readonly session: string,
    private lastSeq: number | undefined, // the last step pushed: given out, or queued to be
    private readonly noticesMax: number,
    private readonly unwatch: () => Promise<void>,
  ) {}

  [Symbol.asyncIterator](): WatchIterator {
    return this;
  }

  next(): Promise<IteratorResult<Notice>> {
    const notice = this.queue.shift();
    if (notice !== undefined) return Promise.resolve({ value: notice, done: false });
    if (this.error !== null) return Promise.reject(this.error);
    if (this.ended) return Promise.resolve({ value: undefined, done: true });
    return new Promise((resolve, reject) => this.pulls.push({ resolve, reject }));
  }

  /** The consumer stopped early (`break`): unwatch, so the daemon stops sending. */
  async return(): Promise<IteratorResult<Notice>> {
    const watching = !this.ended && this.error === null;
    this.finish();
    this.queue.length = 0;
    if (watching) await this.unwatch();
    return { value: undefined, done: true };
  }

  push(notice: Notice): void {
    if (this.ended || this.error !== null) return;
    if (notice.method === "session/unwatched") {
      this.ended = true;
    } else if (this.queue.length >= this.noticesMax) {
      // The consumer is slower than the daemon: stop holding notices rather than grow without bound.
      const behind = `its consumer fell ${this.noticesMax} notices behind`;
      const before = notice.method === "session/actions" ? notice.params.seq - 1 : 0;
      this.fail(new FellBehindError(this.session, this.lastSeq ?? before, behind));
      this.unwatch().catch(() => undefined); // nothing to tell: the consumer has its error
      return;
    } else if (notice.method === "session/actions") {
      this.lastSeq = notice.params.seq; // the agent runtime's delta and stalled notices are not steps
    }
    const pull = this.pulls.shift();
    if (pull !== undefined) pull.resolve({ value: notice, done: false });
    else this.queue.push(notice);
  }

  /** Nothing more will come: after the notices queued, the consumer gets error. */
  fail(error: Error): void {
    this.error = error;
    for (const pull of this.pulls.splice(0)) pull.reject(error); // pulls wait only on an empty queue
  }

  /** Nothing more will come: after the notices queued, the loop ends. */
  finish(): void {
    this.ended = true;
    for (const pull of this.pulls.splice(0)) pull.resolve({ value: undefined, done: true });
  }
}
