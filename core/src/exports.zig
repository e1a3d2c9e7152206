//! The C ABI of the devd core, version 2: every export of the module lives
//! here, and every pointer and length the host passes is checked here before
//! anything else reads it. The logic lives in session.zig (the state
//! machine), snapshot.zig (the codec) and messages.zig (the messages).
//!
//! One session per instance. Persistent state lives in the core's allocator
//! (pages.zig); each call's scratch lives in an arena that is
//! reset (keeping at most 64 KiB) when the call returns; answers are handed
//! over as a `dev_buf` {ptr, len, cap: u32 LE} written at `out` and given
//! back with `dev_free(out)`.
const std = @import("std");
const builtin = @import("builtin");
const msg = @import("messages.zig");
const session = @import("session.zig");
const snapshot = @import("snapshot.zig");
const Session = session.Session;
const Writer = std.Io.Writer;
const oom = msg.oom;

const gpa = @import("pages.zig").allocator;

/// ABI 2 is ABI 1 with the generic Tool call (a reply's `{"Tool":{"name","input"}}`,
/// its action and its `Tool` result event) and the bounded conversation (the
/// `Summary` event, refused as MALFORMED where the session cannot take it):
/// the same exports, and every snapshot and event of ABI 1 reads the same.
pub const ABI: i32 = 2;

const OK: i32 = 0;
const HANDLE: i32 = -1;
const MALFORMED: i32 = -2;
const POISON: i32 = -3;
const NULL: i32 = -5;
const FULL: i32 = -7;
// -4 PANIC is what the host reports for a trap; -6 BUSY is the host's own.

/// The one session's handle.
const handle_value: u64 = 1;

/// Set on entry of every export that touches state and cleared by `defer`.
/// A trap skips the defer, so the next call finds it set: POISON.
var in_call: bool = false;
var the_session: ?Session = null;
var arena_state: std.heap.ArenaAllocator.State = .init;

/// What the core has lent and not had back: inputs from dev_alloc and
/// answers written to `out`. dev_release and dev_free only free what is here.
const Loan = struct { ptr: usize, len: usize, answer: bool };
var loans: std.ArrayList(Loan) = .empty;

comptime {
    if (builtin.cpu.arch != .wasm32) @compileError("the core is built for wasm32");
}

fn memoryLen() usize {
    return @wasmMemorySize(0) * std.wasm.page_size;
}

/// The host's bytes at ptr..ptr+len, or null when they are not all inside
/// memory. A null pointer is only allowed with a zero length (empty input).
fn hostBytes(ptr: i32, len: i32) ?[]u8 {
    if (len < 0) return null;
    const p: usize = @as(u32, @bitCast(ptr));
    const n: usize = @intCast(len);
    if (p == 0) return if (n == 0) &.{} else null;
    if (p > memoryLen() or n > memoryLen() - p) return null;
    return @as([*]u8, @ptrFromInt(p))[0..n];
}

/// The 12 bytes at `out`, or null when `out` is null or not inside memory.
fn outBytes(out: i32) ?*[12]u8 {
    const p: usize = @as(u32, @bitCast(out));
    if (p == 0 or p > memoryLen() or 12 > memoryLen() - p) return null;
    return @ptrFromInt(p);
}

fn findLoan(ptr: usize, len: usize, answer: bool) ?usize {
    for (loans.items, 0..) |l, i| {
        if (l.ptr == ptr and l.len == len and l.answer == answer) return i;
    }
    return null;
}

/// Hands `buf` (its whole capacity allocated from gpa) over as a dev_buf at `o`.
fn handOver(o: *[12]u8, buf: *Writer.Allocating) void {
    const mem = buf.writer.buffer;
    const len = buf.writer.end;
    loans.ensureUnusedCapacity(gpa, 1) catch oom();
    loans.appendAssumeCapacity(.{ .ptr = @intFromPtr(mem.ptr), .len = mem.len, .answer = true });
    std.mem.writeInt(u32, o[0..4], @intCast(@intFromPtr(mem.ptr)), .little);
    std.mem.writeInt(u32, o[4..8], @intCast(len), .little);
    std.mem.writeInt(u32, o[8..12], @intCast(mem.len), .little);
}

fn resetArena(arena: *std.heap.ArenaAllocator) void {
    _ = arena.reset(.{ .retain_with_limit = 64 * 1024 });
    arena_state = arena.state;
}

fn live(handle: i64) ?*Session {
    if (@as(u64, @bitCast(handle)) != handle_value) return null;
    return if (the_session) |*s| s else null;
}

export fn dev_abi() i32 {
    return ABI;
}

/// A pointer to n bytes, or 0 when the core cannot lend them. Never traps.
export fn dev_alloc(n: i32) i32 {
    if (in_call or n <= 0) return 0;
    in_call = true;
    defer in_call = false;
    const len: usize = @intCast(n);
    loans.ensureUnusedCapacity(gpa, 1) catch return 0;
    const mem = gpa.alloc(u8, len) catch return 0;
    loans.appendAssumeCapacity(.{ .ptr = @intFromPtr(mem.ptr), .len = len, .answer = false });
    return @bitCast(@as(u32, @intCast(@intFromPtr(mem.ptr))));
}

/// Gives back what dev_alloc lent: anything else is ignored.
export fn dev_release(ptr: i32, len: i32) void {
    if (in_call or len <= 0) return;
    in_call = true;
    defer in_call = false;
    const i = findLoan(@as(u32, @bitCast(ptr)), @intCast(len), false) orelse return;
    const l = loans.swapRemove(i);
    gpa.free(@as([*]u8, @ptrFromInt(l.ptr))[0..l.len]);
}

/// Frees the dev_buf at `out` and zeroes it. A dev_buf the core did not
/// hand over (e.g. the zeroes an error left) frees nothing.
export fn dev_free(out: i32) void {
    if (in_call) return;
    in_call = true;
    defer in_call = false;
    const o = outBytes(out) orelse return;
    const ptr = std.mem.readInt(u32, o[0..4], .little);
    const cap = std.mem.readInt(u32, o[8..12], .little);
    @memset(o, 0);
    if (ptr == 0) return;
    const i = findLoan(ptr, cap, true) orelse return;
    const l = loans.swapRemove(i);
    gpa.free(@as([*]u8, @ptrFromInt(l.ptr))[0..l.len]);
}

/// Starts the instance's session from a Config (empty input: `{}`) and
/// writes its handle (u64 LE) at `out`.
export fn dev_new(ptr: i32, len: i32, out: i32) i32 {
    if (in_call) return POISON;
    in_call = true;
    defer in_call = false;
    const o = outBytes(out) orelse return NULL;
    @memset(o, 0);
    const input = hostBytes(ptr, len) orelse return NULL;
    if (the_session != null) return FULL;

    var arena = arena_state.promote(gpa);
    defer resetArena(&arena);
    const cfg: msg.Config = if (input.len == 0)
        .{}
    else
        msg.parseConfig(arena.allocator(), input) catch return MALFORMED;
    the_session = .init(gpa, cfg);
    std.mem.writeInt(u64, o[0..8], handle_value, .little);
    return OK;
}

/// Rebuilds the instance's session from a snapshot and writes its handle at `out`.
export fn dev_restore(ptr: i32, len: i32, out: i32) i32 {
    return restoreAs(ptr, len, out, .checked);
}

/// dev_restore for a snapshot this core wrote, read back from the host's own
/// store: the frame, the checksum and the state's invariants are checked,
/// the messages are not parsed again (that costs what the transcript costs,
/// at every wake and restart). Never for a snapshot a client hands over.
/// Optional (ABI 1 and 2): a host must not count on it.
export fn dev_resume(ptr: i32, len: i32, out: i32) i32 {
    return restoreAs(ptr, len, out, .own);
}

fn restoreAs(ptr: i32, len: i32, out: i32, trust: snapshot.Trust) i32 {
    if (in_call) return POISON;
    in_call = true;
    defer in_call = false;
    const o = outBytes(out) orelse return NULL;
    @memset(o, 0);
    const input = hostBytes(ptr, len) orelse return NULL;
    if (the_session != null) return FULL;

    var arena = arena_state.promote(gpa);
    defer resetArena(&arena);
    the_session = snapshot.decodeAs(gpa, arena.allocator(), input, trust) catch return MALFORMED;
    std.mem.writeInt(u64, o[0..8], handle_value, .little);
    return OK;
}

/// Steps the session with one Event and writes its answer, a JSON array of
/// actions, as a dev_buf at `out`.
export fn dev_step(handle: i64, ptr: i32, len: i32, out: i32) i32 {
    if (in_call) return POISON;
    in_call = true;
    defer in_call = false;
    const o = outBytes(out) orelse return NULL;
    @memset(o, 0);
    const s = live(handle) orelse return HANDLE;
    const input = hostBytes(ptr, len) orelse return NULL;

    var arena = arena_state.promote(gpa);
    defer resetArena(&arena);
    const ev = msg.parseEvent(arena.allocator(), input) catch return MALFORMED;
    // A Summary the session cannot take as it stands is refused as unreadable events are: nothing changes.
    if (s.refuses(ev)) return MALFORMED;

    var buf = Writer.Allocating.initCapacity(gpa, 256) catch oom();
    var answer: session.Answer = .init(&buf);
    answer.begin();
    s.step(ev, &answer);
    answer.finish();
    handOver(o, &buf);
    return OK;
}

/// Steps the session with one Event as dev_step does, and writes no answer:
/// a host replaying its journal already has the answers, and writing each
/// Model ask again (the whole transcript) would make a replay cost the square
/// of its length. Optional (ABI 1 and 2): a host must not count on it.
export fn dev_apply(handle: i64, ptr: i32, len: i32) i32 {
    if (in_call) return POISON;
    in_call = true;
    defer in_call = false;
    const s = live(handle) orelse return HANDLE;
    const input = hostBytes(ptr, len) orelse return NULL;

    var arena = arena_state.promote(gpa);
    defer resetArena(&arena);
    const ev = msg.parseEvent(arena.allocator(), input) catch return MALFORMED;
    // A Summary the session cannot take as it stands is refused as unreadable events are: nothing changes.
    if (s.refuses(ev)) return MALFORMED;

    // The other actions are as small as the event and are dropped with the arena.
    var buf: Writer.Allocating = .init(arena.allocator());
    var answer: session.Answer = .init(&buf);
    answer.quiet = true;
    s.step(ev, &answer);
    return OK;
}

/// 1 when the instance trapped because its memory cap refused what it asked
/// for, else 0: the host tells that from a bug, and refuses the call as too
/// large for the session instead of poisoning it. Callable after a trap: it
/// reads one flag and skips the in_call guard a trap leaves set. Optional (ABI 1
/// and 2).
export fn dev_out_of_memory() i32 {
    return @intFromBool(msg.out_of_memory);
}

/// The action id the last dev_step or dev_apply ignored (a Model answer or
/// a result for an action the session did not dispatch, or already had the
/// answer of), or -1 when it ignored none. Optional (ABI 1 and 2).
export fn dev_ignored(handle: i64) i64 {
    if (in_call) return -1;
    const s = live(handle) orelse return -1;
    const id = s.ignored orelse return -1;
    return std.math.cast(i64, id) orelse -1;
}

/// Writes the actions the session has dispatched and still waits for, a JSON
/// array in the bytes dev_step wrote them, as a dev_buf at `out`: the running
/// turn's Model ask, or its calls without a result in id order; `[]` when no
/// turn runs. Optional (ABI 1 and 2): a host must not count on it.
export fn dev_pending(handle: i64, out: i32) i32 {
    if (in_call) return POISON;
    in_call = true;
    defer in_call = false;
    const o = outBytes(out) orelse return NULL;
    @memset(o, 0);
    const s = live(handle) orelse return HANDLE;

    var arena = arena_state.promote(gpa);
    defer resetArena(&arena);
    var buf = Writer.Allocating.initCapacity(gpa, 256) catch oom();
    var answer: session.Answer = .init(&buf);
    answer.begin();
    s.writePending(arena.allocator(), &answer);
    answer.finish();
    handOver(o, &buf);
    return OK;
}

/// Writes the session's transcript from message `from` on (0: all of it; none
/// past its end) as a JSON array of Messages, a dev_buf at `out`. Optional (ABI 1
/// and 2): a host must not count on it.
export fn dev_transcript(handle: i64, from: i32, out: i32) i32 {
    if (in_call) return POISON;
    in_call = true;
    defer in_call = false;
    const o = outBytes(out) orelse return NULL;
    @memset(o, 0);
    const s = live(handle) orelse return HANDLE;
    if (from < 0) return MALFORMED;
    var buf = Writer.Allocating.init(gpa);
    s.writeTranscript(@intCast(from), &buf);
    handOver(o, &buf);
    return OK;
}

/// Writes the session's snapshot as a dev_buf at `out`.
export fn dev_snapshot(handle: i64, out: i32) i32 {
    if (in_call) return POISON;
    in_call = true;
    defer in_call = false;
    const o = outBytes(out) orelse return NULL;
    @memset(o, 0);
    const s = live(handle) orelse return HANDLE;
    var buf = snapshot.encode(gpa, s);
    handOver(o, &buf);
    return OK;
}
