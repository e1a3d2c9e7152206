//! The snapshot codec: a session's whole state as bytes, and back.
//!
//! Layout (all integers little-endian):
//!
//!     "DEVD"  u32 layout  u32 body_len  body[body_len]  u32 crc32
//!
//! where the CRC-32 (ISO-HDLC, the value of std.hash.Crc32) covers every byte before it.
//! The body is a deterministic binary encoding (`str` is u32 length + bytes):
//!
//!     u8 has_model [str model]
//!     u64 counter  u64 max_turn
//!     u8 running [u64 turn  u8 phase (0: u64 ask_id | 1: u32 n, n × slot)]
//!         slot = u64 id  u8 family  u8 pending  u8 failed  str text
//!     u32 queued, queued × (u64 turn  str prompt)
//!     u32 messages, messages × str (one compact JSON Message each)
//!     [layout 2 only: u64 sent_from  u64 sent_to]
//!
//! Layout 1 is a session whose asks carry the whole transcript (the default);
//! layout 2 one whose asks carry what the model was not sent (config
//! `asks: delta`), and the range its last ask carried. A default session's
//! snapshot is the same bytes it always was.
//! Decoding checks the frame, the checksum, and then every field and every
//! invariant of the state, so a snapshot that is damaged but happens to
//! carry a matching checksum is still refused rather than trusted. One such
//! invariant: while calls are waited for, the last message is the Agent
//! message that dispatched them, one Dispatch per slot with the same ids and
//! families: dev_pending re-derives the pending calls' actions from it, so
//! the layout does not carry them. A Summary message (ABI 2) is only ever
//! the first; after one, a delta session's next ask sends everything again
//! (sent_to 0, calls or not). The layouts are ABI 1's: a snapshot without a
//! Summary or a Tool call is the bytes an ABI-1 core wrote.
const std = @import("std");
const Allocator = std.mem.Allocator;
const Writer = std.Io.Writer;
const msg = @import("messages.zig");
const oom = msg.oom;
const session = @import("session.zig");
const Session = session.Session;
const Slot = session.Slot;

pub const magic = "DEVD";
/// The layouts: the whole transcript in every ask, or the part not sent.
pub const layout_full: u32 = 1;
pub const layout_delta: u32 = 2;
const header_len = 12;
/// The highest id counter a snapshot may carry.
pub const max_counter: u64 = 1 << 53;
const trailer_len = 4;

/// CRC-32/ISO-HDLC, the value std.hash.Crc32 gives, eight bytes at a time
/// (slicing-by-8): the std one reads a byte at a time, and a wake or a
/// restart checks a whole snapshot, megabytes for a long session.
pub fn crc32(bytes: []const u8) u32 {
    const t = crcTables();
    var c: u32 = 0xffff_ffff;
    var i: usize = 0;
    while (bytes.len - i >= 8) : (i += 8) {
        const lo = std.mem.readInt(u32, bytes[i..][0..4], .little) ^ c;
        const hi = std.mem.readInt(u32, bytes[i + 4 ..][0..4], .little);
        c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
            t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    }
    for (bytes[i..]) |b| c = t[0][(c ^ b) & 0xff] ^ (c >> 8);
    return ~c;
}

/// Filled on first use, not stored in the module: as data, its 8 KiB would be
/// copied into every instance's memory when it starts, snapshot or not.
var crc_tables: [8][256]u32 = std.mem.zeroes([8][256]u32);
var crc_tables_filled = false;

fn crcTables() *const [8][256]u32 {
    if (crc_tables_filled) return &crc_tables;
    const t = &crc_tables;
    for (0..256) |n| {
        var c: u32 = @intCast(n);
        for (0..8) |_| c = if (c & 1 != 0) 0xedb8_8320 ^ (c >> 1) else c >> 1;
        t[0][n] = c;
    }
    for (0..256) |n| {
        for (1..8) |k| t[k][n] = t[0][t[k - 1][n] & 0xff] ^ (t[k - 1][n] >> 8);
    }
    crc_tables_filled = true;
    return t;
}

// ---------------------------------------------------------------- encoding

const Enc = struct {
    w: *Writer,

    fn int(e: Enc, comptime T: type, v: T) void {
        e.w.writeInt(T, v, .little) catch oom();
    }

    fn str(e: Enc, s: []const u8) void {
        e.int(u32, std.math.cast(u32, s.len) orelse oom());
        e.w.writeAll(s) catch oom();
    }
};

/// The snapshot of `s`, in a buffer from `gpa` (its capacity may exceed its length).
pub fn encode(gpa: Allocator, s: *const Session) Writer.Allocating {
    // Sized up front (a close upper bound) so a large state is not built by
    // repeated growth.
    var need: usize = 256;
    if (s.model) |m| need +|= m.len;
    if (s.running) |r| switch (r.phase) {
        .asking => {},
        .calls => |slots| for (slots.items) |sl| {
            need +|= sl.text.len + 16;
        },
    };
    for (s.queue.items) |q| need +|= q.prompt.len + 12;
    for (s.transcript.items) |f| need +|= f.len + 4;
    var out = Writer.Allocating.initCapacity(gpa, need) catch oom();
    const e: Enc = .{ .w = &out.writer };
    e.w.writeAll(magic) catch oom();
    e.int(u32, if (s.delta) layout_delta else layout_full);
    e.int(u32, 0); // body length, patched below

    if (s.model) |m| {
        e.int(u8, 1);
        e.str(m);
    } else e.int(u8, 0);
    e.int(u64, s.counter);
    e.int(u64, s.max_turn);
    if (s.running) |r| {
        e.int(u8, 1);
        e.int(u64, r.turn);
        switch (r.phase) {
            .asking => |id| {
                e.int(u8, 0);
                e.int(u64, id);
            },
            .calls => |slots| {
                e.int(u8, 1);
                e.int(u32, std.math.cast(u32, slots.items.len) orelse oom());
                for (slots.items) |sl| {
                    e.int(u64, sl.id);
                    e.int(u8, @backingInt(sl.family));
                    e.int(u8, @intFromBool(sl.pending));
                    e.int(u8, @intFromBool(sl.failed));
                    e.str(sl.text);
                }
            },
        }
    } else e.int(u8, 0);
    e.int(u32, std.math.cast(u32, s.queue.items.len) orelse oom());
    for (s.queue.items) |q| {
        e.int(u64, q.turn);
        e.str(q.prompt);
    }
    e.int(u32, std.math.cast(u32, s.transcript.items.len) orelse oom());
    for (s.transcript.items) |f| e.str(f);
    if (s.delta) {
        e.int(u64, s.sent_from);
        e.int(u64, s.sent_to);
    }

    const bytes = out.written();
    const body_len = std.math.cast(u32, bytes.len - header_len) orelse oom();
    std.mem.writeInt(u32, bytes[8..12], body_len, .little);
    const crc = crc32(bytes);
    out.writer.writeInt(u32, crc, .little) catch oom();
    return out;
}

// ---------------------------------------------------------------- decoding

pub const Error = msg.Error;

const Dec = struct {
    b: []const u8,
    i: usize = 0,

    fn take(d: *Dec, n: usize) Error![]const u8 {
        if (d.b.len - d.i < n) return error.Malformed;
        defer d.i += n;
        return d.b[d.i..][0..n];
    }

    fn int(d: *Dec, comptime T: type) Error!T {
        const bytes = try d.take(@sizeOf(T));
        return std.mem.readInt(T, bytes[0..@sizeOf(T)], .little);
    }

    fn flag(d: *Dec) Error!bool {
        return switch (try d.int(u8)) {
            0 => false,
            1 => true,
            else => error.Malformed,
        };
    }

    /// A length-prefixed string, which must be valid UTF-8.
    fn str(d: *Dec) Error![]const u8 {
        const s = try d.raw();
        if (!std.unicode.utf8ValidateSlice(s)) return error.Malformed;
        return s;
    }

    /// A length-prefixed string taken as it is: one this core wrote, under a checksum that matched.
    fn raw(d: *Dec) Error![]const u8 {
        const n = try d.int(u32);
        return d.take(n);
    }
};

/// Rebuilds a session from a snapshot. The result owns its memory in `gpa`;
/// `arena` is scratch. Any damage answers `error.Malformed`.
pub fn decode(gpa: Allocator, arena: Allocator, bytes: []const u8) Error!Session {
    return decodeAs(gpa, arena, bytes, .checked);
}

/// How far a snapshot's messages are checked: `checked` parses each and
/// takes it back only as this core writes it (a snapshot from a client);
/// `own` trusts the frame and the checksum for them (a snapshot this core
/// wrote, read back from the host's own store), since parsing every message
/// costs what the transcript costs, and a wake or a restart pays it.
pub const Trust = enum { checked, own };

pub fn decodeAs(gpa: Allocator, arena: Allocator, bytes: []const u8, trust: Trust) Error!Session {
    if (bytes.len < header_len + trailer_len) return error.Malformed;
    if (!std.mem.eql(u8, bytes[0..4], magic)) return error.Malformed;
    const layout = std.mem.readInt(u32, bytes[4..8], .little);
    if (layout != layout_full and layout != layout_delta) return error.Malformed;
    const body_len = std.mem.readInt(u32, bytes[8..12], .little);
    if (bytes.len - header_len - trailer_len != body_len) return error.Malformed;
    const crc_at = bytes.len - trailer_len;
    const crc = std.mem.readInt(u32, bytes[crc_at..][0..4], .little);
    if (crc32(bytes[0..crc_at]) != crc) return error.Malformed;

    // Built in the arena, pointing into `bytes`, and copied into `gpa` only
    // once every check has passed.
    var d: Dec = .{ .b = bytes[header_len..crc_at] };
    var s: Session = .{ .gpa = arena, .delta = layout == layout_delta };
    if (try d.flag()) s.model = @constCast(try d.str());
    s.counter = try d.int(u64);
    // A counter no session can reach honestly: refused here, rather than restored into a session whose every
    // later step would run out of ids and trap. 2^53 is also the last id a JavaScript client reads exactly.
    if (s.counter > max_counter) return error.Malformed;
    s.max_turn = try d.int(u64);

    if (try d.flag()) {
        const turn = try d.int(u64);
        if (turn == 0 or turn > s.max_turn) return error.Malformed;
        var r: session.Running = .{ .turn = turn, .phase = .{ .asking = 0 } };
        switch (try d.int(u8)) {
            0 => {
                const id = try d.int(u64);
                if (id == 0 or id > s.counter) return error.Malformed;
                r.phase = .{ .asking = id };
            },
            1 => {
                const n = try d.int(u32);
                if (n == 0 or n > d.b.len) return error.Malformed;
                var slots: std.ArrayList(Slot) = .empty;
                var pending: usize = 0;
                var last: u64 = 0;
                for (0..n) |_| {
                    const id = try d.int(u64);
                    if (id <= last or id > s.counter) return error.Malformed;
                    last = id;
                    const family = std.enums.fromInt(msg.Family, try d.int(u8)) orelse return error.Malformed;
                    const is_pending = try d.flag();
                    const failed = try d.flag();
                    const text = try d.str();
                    if (is_pending) {
                        if (failed or text.len != 0) return error.Malformed;
                        pending += 1;
                    }
                    slots.append(arena, .{
                        .id = id,
                        .family = family,
                        .pending = is_pending,
                        .failed = failed,
                        .text = @constCast(text),
                    }) catch oom();
                }
                if (pending == 0) return error.Malformed;
                r.phase = .{ .calls = slots };
            },
            else => return error.Malformed,
        }
        s.running = r;
    } else if (try d.int(u32) == 0) {
        // No turn is running, so none may be queued: the count must be 0
        // (it is read here, and the loop below sees an empty queue).
        return finishDecode(gpa, arena, &d, &s, 0, trust);
    } else return error.Malformed;

    return finishDecode(gpa, arena, &d, &s, try d.int(u32), trust);
}

fn finishDecode(gpa: Allocator, arena: Allocator, d: *Dec, s: *Session, queued: u32, trust: Trust) Error!Session {
    if (queued > d.b.len) return error.Malformed;
    var last = if (s.running) |r| r.turn else 0;
    for (0..queued) |_| {
        const turn = try d.int(u64);
        if (turn <= last or turn > s.max_turn) return error.Malformed;
        last = turn;
        s.queue.append(arena, .{ .turn = turn, .prompt = @constCast(try d.str()) }) catch oom();
    }

    const messages = try d.int(u32);
    if (messages > d.b.len) return error.Malformed;
    // Each message's check in scratch of its own, let go before the next: a long transcript is not held twice over.
    var scratch: std.heap.ArenaAllocator = .init(gpa);
    defer scratch.deinit();
    for (0..messages) |_| {
        const f = if (trust == .checked) try d.str() else try d.raw();
        // A Summary stands only for the start of the conversation.
        if (s.transcript.items.len != 0 and session.isKind(f, "Summary")) return error.Malformed;
        if (trust == .checked) {
            defer _ = scratch.reset(.retain_capacity);
            // Only a Message exactly as this core writes it is taken back.
            const m = try msg.parseMessage(scratch.allocator(), f);
            var canon: Writer.Allocating = .init(scratch.allocator());
            msg.writeMessage(&canon.writer, m) catch oom();
            if (!std.mem.eql(u8, canon.written(), f)) return error.Malformed;
        }
        s.transcript.append(arena, @constCast(f)) catch oom();
    }
    if (s.delta) {
        s.sent_from = std.math.cast(usize, try d.int(u64)) orelse return error.Malformed;
        s.sent_to = std.math.cast(usize, try d.int(u64)) orelse return error.Malformed;
        if (s.sent_from > s.sent_to or s.sent_to > messages) return error.Malformed;
        // While an ask is waited for, nothing has been added since it was sent; while calls are, only the
        // message that dispatched them, unless a Summary since has the next ask send everything (sent_to 0).
        if (s.running) |r| switch (r.phase) {
            .asking => if (s.sent_to != messages) return error.Malformed,
            .calls => if (s.sent_to + 1 != messages and !(s.sent_to == 0 and session.isKind(s.transcript.items[0], "Summary"))) return error.Malformed,
        };
    }
    if (d.i != d.b.len) return error.Malformed;
    if (s.running) |r| switch (r.phase) {
        .asking => {},
        // The calls waited for are those the last message dispatched, one
        // slot each, in order: dev_pending re-derives their actions from it.
        .calls => |slots| {
            const ds = session.dispatched(arena, s.transcript.items) orelse return error.Malformed;
            if (ds.len != slots.items.len) return error.Malformed;
            for (slots.items, ds) |sl, x| {
                if (sl.id != x.id or sl.family != x.call.family()) return error.Malformed;
            }
        },
    };
    return s.clone(gpa);
}
