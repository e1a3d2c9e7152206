//! The protocol's messages: their types, a strict decoder and a compact
//! encoder.
//!
//! Decoding is done by hand on top of `std.json.Scanner` rather than with
//! `std.json.parseFromSlice`, because the protocol is stricter than std.json's
//! typed parser: a u64 must be a JSON integer (std.json accepts "5"), a union
//! is an object with exactly one member, and `{"Timer":true}` is not a void
//! union member.  Every syntax or shape error is `error.Malformed`; running out
//! of memory is never an error here, it traps (see `oom`).
//!
//! Decoded strings may point into the input buffer (or into the arena when
//! they had escapes): whoever keeps one must dupe it.
const std = @import("std");
const Allocator = std.mem.Allocator;
const Scanner = std.json.Scanner;
const Token = std.json.Token;
const Writer = std.Io.Writer;

pub const Error = error{Malformed};

/// Set just before the core traps for want of memory, so the host can tell
/// that trap from a bug (dev_out_of_memory).
pub var out_of_memory: bool = false;

/// Out of memory anywhere in the core is a trap, never a status: the host
/// caps memory at 64 MiB, and a call that needs more must answer PANIC.
pub fn oom() noreturn {
    out_of_memory = true;
    @panic("out of memory");
}

/// The result family a call's outcome comes back under.
pub const Family = enum(u8) { exec = 0, file = 1, git = 2, browse = 3, tool = 4 };

pub const Write = struct { path: []const u8, text: []const u8 };

/// A generic call (ABI 2): a tool by `name`, with `input` as the model gave
/// it, the raw bytes of one JSON value. Decoded leniently (any string, any
/// value) so that a malformed one is refused to the model, not the event to
/// the host: see `refusal`.
pub const Named = struct { name: []const u8, input: []const u8 };

/// The longest tool name, in bytes.
pub const tool_name_bytes_max = 128;

/// Whether `name` is a tool's name: 1-128 bytes of `[A-Za-z0-9_.:/-]`.
pub fn isToolName(name: []const u8) bool {
    if (name.len == 0 or name.len > tool_name_bytes_max) return false;
    for (name) |c| switch (c) {
        'A'...'Z', 'a'...'z', '0'...'9', '_', '.', ':', '/', '-' => {},
        else => return false,
    };
    return true;
}

pub const Call = union(enum) {
    exec: []const []const u8, // argv
    read: []const u8, // path
    write: Write,
    git: []const []const u8, // argv
    browse: []const u8, // url
    tool: Named,

    pub fn family(c: Call) Family {
        return switch (c) {
            .exec => .exec,
            .read, .write => .file,
            .git => .git,
            .browse => .browse,
            .tool => .tool,
        };
    }

    /// The workspace path the call touches, if it is a file call.
    pub fn path(c: Call) ?[]const u8 {
        return switch (c) {
            .read => |p| p,
            .write => |w| w.path,
            else => null,
        };
    }

    /// Why the call is never dispatched, written to `w`, or false when it
    /// may be: a path outside the workspace, a tool name that is not one,
    /// a tool input that is not a JSON object. The model is told this text
    /// as the call's failed result.
    pub fn refusal(c: Call, w: *Writer) Writer.Error!bool {
        if (c.path()) |p| if (!insideWorkspace(p)) {
            try w.print("refused: {s} is not inside the workspace", .{p});
            return true;
        };
        const t = switch (c) {
            .tool => |t| t,
            else => return false,
        };
        if (t.name.len > tool_name_bytes_max) {
            try w.print("refused: a tool name is at most {d} bytes, and this one is {d}", .{ tool_name_bytes_max, t.name.len });
            return true;
        }
        if (!isToolName(t.name)) {
            try w.writeAll("refused: ");
            try writeString(w, t.name);
            try w.writeAll(" is not a tool name (1-128 bytes of A-Z a-z 0-9 _ . : / -)");
            return true;
        }
        if (t.input[0] != '{') {
            try w.print("refused: the input of {s} is not a JSON object", .{t.name});
            return true;
        }
        return false;
    }
};

pub const Reply = struct { text: ?[]const u8 = null, calls: []const Call = &.{} };

/// A tool's outcome, as an event carries it and as a Tool message records it.
pub const Output = struct { id: u64, text: []const u8, failed: bool = false };

/// The bounded conversation (ABI 2): messages `0..upto` of the transcript
/// are replaced by one Summary message holding `text`.
pub const Summarize = struct { upto: u64, text: []const u8 };

pub const Event = union(enum) {
    turn: struct { id: u64, prompt: []const u8 },
    model: struct { id: u64, reply: Reply },
    result: struct { family: Family, out: Output },
    cancel: u64, // the turn
    timer,
    summary: Summarize,
};

pub const Dispatch = struct { id: u64, call: Call };

pub const Agent = struct { text: ?[]const u8 = null, calls: []const Dispatch = &.{} };

/// What stands for the start of the conversation once it was summarised:
/// the summary's `text`, and how many messages of the whole conversation it
/// replaces (every summary's before it included). Only ever the first message.
pub const Summary = struct { text: []const u8, replaced: u64 };

pub const Message = union(enum) {
    user: []const u8,
    agent: Agent,
    tool: Output,
    summary: Summary,
};

/// What a Model ask carries: the whole transcript (the seed's contract), or
/// only the messages added since the previous ask, with where they start.
pub const Asks = enum { full, delta };

pub const Config = struct { model: ?[]const u8 = null, asks: Asks = .full };

// ---------------------------------------------------------------- decoding

const Parser = struct {
    sc: Scanner,
    arena: Allocator,

    fn init(arena: Allocator, src: []const u8) Parser {
        return .{ .sc = Scanner.initCompleteInput(arena, src), .arena = arena };
    }

    /// The next token. A string with escapes is unescaped into room for its
    /// raw length, taken at once: std grows it by half again piece by piece,
    /// and in the arena every growth kept the old copy as well (a 2 MiB tool
    /// output with a newline every other byte took 18 MiB to read).
    fn next(p: *Parser) Error!Token {
        const raw = if (try p.peek() == .string) escapedLength(p.sc.input, p.sc.cursor) else null;
        const n = raw orelse return p.sc.nextAllocMax(p.arena, .alloc_if_needed, std.math.maxInt(usize)) catch |e| switch (e) {
            error.OutOfMemory => oom(),
            else => error.Malformed,
        };
        var list = std.array_list.Managed(u8).initCapacity(p.arena, n) catch oom();
        const plain = p.sc.allocNextIntoArrayListMax(&list, .alloc_if_needed, std.math.maxInt(usize)) catch |e| switch (e) {
            error.OutOfMemory => oom(),
            else => return error.Malformed,
        };
        return if (plain) |slice| .{ .string = slice } else .{ .allocated_string = list.items };
    }

    /// The length between the quotes of the string opening at `at`, when it
    /// has an escape (unescaped, it is no longer); null when it has none.
    fn escapedLength(input: []const u8, at: usize) ?usize {
        if (at >= input.len or input[at] != '"') return null;
        var i = std.mem.indexOfAnyPos(u8, input, at + 1, "\"\\") orelse return null;
        if (input[i] == '"') return null;
        while (input[i] == '\\') {
            i = std.mem.indexOfAnyPos(u8, input, i + 2, "\"\\") orelse return null;
        }
        return i - (at + 1);
    }

    fn peek(p: *Parser) Error!std.json.TokenType {
        return p.sc.peekNextTokenType() catch error.Malformed;
    }

    fn expect(p: *Parser, comptime tag: std.meta.Tag(Token)) Error!void {
        if (std.meta.activeTag(try p.next()) != tag) return error.Malformed;
    }

    fn string(p: *Parser) Error![]const u8 {
        return switch (try p.next()) {
            .string => |s| s,
            .allocated_string => |s| s,
            else => error.Malformed,
        };
    }

    /// A JSON integer in 0..2^64-1: no sign, no fraction, no exponent, no string.
    fn int(p: *Parser) Error!u64 {
        const s = switch (try p.next()) {
            .number => |s| s,
            .allocated_number => |s| s,
            else => return error.Malformed,
        };
        return parseU64(s);
    }

    fn boolean(p: *Parser) Error!bool {
        return switch (try p.next()) {
            .true => true,
            .false => false,
            else => error.Malformed,
        };
    }

    fn isTrue(p: *Parser) Error!void {
        if (!try p.boolean()) return error.Malformed;
    }

    /// The next member name of an object, or null at its end.
    fn key(p: *Parser) Error!?[]const u8 {
        return switch (try p.next()) {
            .object_end => null,
            .string => |s| s,
            .allocated_string => |s| s,
            else => error.Malformed,
        };
    }

    /// Opens a union: `{` and its one member's name.
    fn unionBegin(p: *Parser) Error![]const u8 {
        try p.expect(.object_begin);
        return (try p.key()) orelse error.Malformed;
    }

    /// Closes a union: a second member is malformed.
    fn unionEnd(p: *Parser) Error!void {
        try p.expect(.object_end);
    }

    fn end(p: *Parser) Error!void {
        try p.expect(.end_of_document);
    }

    /// The next value, any JSON, as its raw bytes in the input (checked, not
    /// decoded): what a Tool call's input is kept as.
    fn rawValue(p: *Parser) Error![]const u8 {
        _ = try p.peek(); // past the whitespace: the cursor is at the value
        const from = p.sc.cursor;
        p.sc.skipValue() catch |e| switch (e) {
            error.OutOfMemory => oom(),
            else => return error.Malformed,
        };
        return p.sc.input[from..p.sc.cursor];
    }

    fn strings(p: *Parser) Error![]const []const u8 {
        try p.expect(.array_begin);
        var list: std.ArrayList([]const u8) = .empty;
        while (try p.peek() != .array_end) {
            list.append(p.arena, try p.string()) catch oom();
        }
        try p.expect(.array_end);
        return list.items;
    }
};

pub fn parseU64(s: []const u8) Error!u64 {
    if (s.len == 0) return error.Malformed;
    var v: u64 = 0;
    for (s) |c| {
        if (c < '0' or c > '9') return error.Malformed;
        v = std.math.mul(u64, v, 10) catch return error.Malformed;
        v = std.math.add(u64, v, c - '0') catch return error.Malformed;
    }
    return v;
}

/// Tracks the members of one object: each at most once, required ones present.
fn Members(comptime names: []const []const u8) type {
    return struct {
        seen: u8 = 0,

        comptime {
            std.debug.assert(names.len <= 8);
        }

        const Self = @This();

        /// The index of `name` among `names`; unknown and repeated members are malformed.
        fn take(m: *Self, name: []const u8) Error!usize {
            inline for (names, 0..) |n, i| {
                if (std.mem.eql(u8, n, name)) {
                    const bit: u8 = 1 << i;
                    if (m.seen & bit != 0) return error.Malformed;
                    m.seen |= bit;
                    return i;
                }
            }
            return error.Malformed;
        }

        fn require(m: Self, comptime name: []const u8) Error!void {
            inline for (names, 0..) |n, i| {
                if (comptime std.mem.eql(u8, n, name)) {
                    if (m.seen & (1 << i) == 0) return error.Malformed;
                    return;
                }
            }
            @compileError("no member " ++ name);
        }
    };
}

fn parseCall(p: *Parser) Error!Call {
    const k = try p.unionBegin();
    const call: Call = if (std.mem.eql(u8, k, "Exec"))
        .{ .exec = try parseArgv(p) }
    else if (std.mem.eql(u8, k, "Git"))
        .{ .git = try parseArgv(p) }
    else if (std.mem.eql(u8, k, "Read"))
        .{ .read = try parseOne(p, "path") }
    else if (std.mem.eql(u8, k, "Browse"))
        .{ .browse = try parseOne(p, "url") }
    else if (std.mem.eql(u8, k, "Tool")) blk: {
        try p.expect(.object_begin);
        var m: Members(&.{ "name", "input" }) = .{};
        var t: Named = .{ .name = "", .input = "" };
        while (try p.key()) |name| switch (try m.take(name)) {
            0 => t.name = try p.string(),
            1 => t.input = try p.rawValue(),
            else => unreachable,
        };
        try m.require("name");
        try m.require("input");
        break :blk .{ .tool = t };
    }
    else if (std.mem.eql(u8, k, "Write")) blk: {
        try p.expect(.object_begin);
        var m: Members(&.{ "path", "text" }) = .{};
        var w: Write = .{ .path = "", .text = "" };
        while (try p.key()) |name| switch (try m.take(name)) {
            0 => w.path = try p.string(),
            1 => w.text = try p.string(),
            else => unreachable,
        };
        try m.require("path");
        try m.require("text");
        break :blk .{ .write = w };
    } else return error.Malformed;
    try p.unionEnd();
    return call;
}

/// `{"argv": [str]}`
fn parseArgv(p: *Parser) Error![]const []const u8 {
    try p.expect(.object_begin);
    const name = (try p.key()) orelse return error.Malformed;
    if (!std.mem.eql(u8, name, "argv")) return error.Malformed;
    const argv = try p.strings();
    try p.expect(.object_end);
    return argv;
}

/// `{"<member>": str}`
fn parseOne(p: *Parser, comptime member: []const u8) Error![]const u8 {
    try p.expect(.object_begin);
    const name = (try p.key()) orelse return error.Malformed;
    if (!std.mem.eql(u8, name, member)) return error.Malformed;
    const s = try p.string();
    try p.expect(.object_end);
    return s;
}

fn parseCalls(p: *Parser) Error![]const Call {
    try p.expect(.array_begin);
    var list: std.ArrayList(Call) = .empty;
    while (try p.peek() != .array_end) {
        list.append(p.arena, try parseCall(p)) catch oom();
    }
    try p.expect(.array_end);
    return list.items;
}

/// `{"id": u64, "text": str, "failed"?: bool}`
fn parseOutput(p: *Parser) Error!Output {
    try p.expect(.object_begin);
    var m: Members(&.{ "id", "text", "failed" }) = .{};
    var o: Output = .{ .id = 0, .text = "" };
    while (try p.key()) |name| switch (try m.take(name)) {
        0 => o.id = try p.int(),
        1 => o.text = try p.string(),
        2 => o.failed = try p.boolean(),
        else => unreachable,
    };
    try m.require("id");
    try m.require("text");
    return o;
}

fn parseReply(p: *Parser) Error!Reply {
    try p.expect(.object_begin);
    var m: Members(&.{ "text", "calls" }) = .{};
    var r: Reply = .{};
    while (try p.key()) |name| switch (try m.take(name)) {
        0 => r.text = try p.string(),
        1 => r.calls = try parseCalls(p),
        else => unreachable,
    };
    return r;
}

/// Decodes one Event. Strings in it may point into `src`.
pub fn parseEvent(arena: Allocator, src: []const u8) Error!Event {
    var p: Parser = .init(arena, src);
    const k = try p.unionBegin();
    var ev: Event = undefined;
    if (std.mem.eql(u8, k, "Turn")) {
        try p.expect(.object_begin);
        var m: Members(&.{ "id", "prompt" }) = .{};
        var id: u64 = 0;
        var prompt: []const u8 = "";
        while (try p.key()) |name| switch (try m.take(name)) {
            0 => id = try p.int(),
            1 => prompt = try p.string(),
            else => unreachable,
        };
        try m.require("id");
        try m.require("prompt");
        ev = .{ .turn = .{ .id = id, .prompt = prompt } };
    } else if (std.mem.eql(u8, k, "Model")) {
        try p.expect(.object_begin);
        var m: Members(&.{ "id", "reply" }) = .{};
        var id: u64 = 0;
        var reply: Reply = .{};
        while (try p.key()) |name| switch (try m.take(name)) {
            0 => id = try p.int(),
            1 => reply = try parseReply(&p),
            else => unreachable,
        };
        try m.require("id");
        try m.require("reply");
        ev = .{ .model = .{ .id = id, .reply = reply } };
    } else if (familyOf(k)) |family| {
        ev = .{ .result = .{ .family = family, .out = try parseOutput(&p) } };
    } else if (std.mem.eql(u8, k, "Cancel")) {
        try p.expect(.object_begin);
        var m: Members(&.{"turn"}) = .{};
        var turn: u64 = 0;
        while (try p.key()) |name| switch (try m.take(name)) {
            0 => turn = try p.int(),
            else => unreachable,
        };
        try m.require("turn");
        ev = .{ .cancel = turn };
    } else if (std.mem.eql(u8, k, "Timer")) {
        try p.isTrue();
        ev = .timer;
    } else if (std.mem.eql(u8, k, "Summary")) {
        try p.expect(.object_begin);
        var m: Members(&.{ "upto", "text" }) = .{};
        var sm: Summarize = .{ .upto = 0, .text = "" };
        while (try p.key()) |name| switch (try m.take(name)) {
            0 => sm.upto = try p.int(),
            1 => sm.text = try p.string(),
            else => unreachable,
        };
        try m.require("upto");
        try m.require("text");
        ev = .{ .summary = sm };
    } else return error.Malformed;
    try p.unionEnd();
    try p.end();
    return ev;
}

fn familyOf(k: []const u8) ?Family {
    if (std.mem.eql(u8, k, "Exec")) return .exec;
    if (std.mem.eql(u8, k, "File")) return .file;
    if (std.mem.eql(u8, k, "Git")) return .git;
    if (std.mem.eql(u8, k, "Browse")) return .browse;
    if (std.mem.eql(u8, k, "Tool")) return .tool;
    return null;
}

/// Decodes a Config. Strings in it may point into `src`.
pub fn parseConfig(arena: Allocator, src: []const u8) Error!Config {
    var p: Parser = .init(arena, src);
    try p.expect(.object_begin);
    var m: Members(&.{ "model", "asks" }) = .{};
    var cfg: Config = .{};
    while (try p.key()) |name| switch (try m.take(name)) {
        0 => cfg.model = try p.string(),
        1 => cfg.asks = std.meta.stringToEnum(Asks, try p.string()) orelse return error.Malformed,
        else => unreachable,
    };
    try p.end();
    return cfg;
}

/// Decodes one transcript Message (used to check a restored snapshot).
pub fn parseMessage(arena: Allocator, src: []const u8) Error!Message {
    var p: Parser = .init(arena, src);
    const k = try p.unionBegin();
    var msg: Message = undefined;
    if (std.mem.eql(u8, k, "User")) {
        msg = .{ .user = try p.string() };
    } else if (std.mem.eql(u8, k, "Tool")) {
        msg = .{ .tool = try parseOutput(&p) };
    } else if (std.mem.eql(u8, k, "Summary")) {
        try p.expect(.object_begin);
        var m: Members(&.{ "text", "replaced" }) = .{};
        var sm: Summary = .{ .text = "", .replaced = 0 };
        while (try p.key()) |name| switch (try m.take(name)) {
            0 => sm.text = try p.string(),
            1 => sm.replaced = try p.int(),
            else => unreachable,
        };
        try m.require("text");
        try m.require("replaced");
        msg = .{ .summary = sm };
    } else if (std.mem.eql(u8, k, "Agent")) {
        try p.expect(.object_begin);
        var m: Members(&.{ "text", "calls" }) = .{};
        var a: Agent = .{};
        while (try p.key()) |name| switch (try m.take(name)) {
            0 => a.text = try p.string(),
            1 => {
                try p.expect(.array_begin);
                var list: std.ArrayList(Dispatch) = .empty;
                while (try p.peek() != .array_end) {
                    try p.expect(.object_begin);
                    var dm: Members(&.{ "id", "call" }) = .{};
                    var d: Dispatch = .{ .id = 0, .call = .{ .browse = "" } };
                    while (try p.key()) |dn| switch (try dm.take(dn)) {
                        0 => d.id = try p.int(),
                        1 => d.call = try parseCall(&p),
                        else => unreachable,
                    };
                    try dm.require("id");
                    try dm.require("call");
                    list.append(arena, d) catch oom();
                }
                try p.expect(.array_end);
                a.calls = list.items;
            },
            else => unreachable,
        };
        msg = .{ .agent = a };
    } else return error.Malformed;
    try p.unionEnd();
    try p.end();
    return msg;
}

// ---------------------------------------------------------------- encoding
//
// Compact JSON, members in the protocol's order, optional members omitted,
// non-ASCII written as raw UTF-8. Every writer here only fails when memory
// runs out.

pub fn writeString(w: *Writer, s: []const u8) Writer.Error!void {
    try std.json.Stringify.encodeJsonString(s, .{}, w);
}

pub fn writeInt(w: *Writer, v: u64) Writer.Error!void {
    try w.print("{d}", .{v});
}

fn writeArgv(w: *Writer, argv: []const []const u8) Writer.Error!void {
    try w.writeAll("{\"argv\":[");
    for (argv, 0..) |a, i| {
        if (i != 0) try w.writeByte(',');
        try writeString(w, a);
    }
    try w.writeAll("]}");
}

/// A Call as its own union member, e.g. `{"Read":{"path":"src/lib.rs"}}`.
pub fn writeCall(w: *Writer, c: Call) Writer.Error!void {
    switch (c) {
        .exec => |argv| {
            try w.writeAll("{\"Exec\":");
            try writeArgv(w, argv);
        },
        .git => |argv| {
            try w.writeAll("{\"Git\":");
            try writeArgv(w, argv);
        },
        .read => |p| {
            try w.writeAll("{\"Read\":{\"path\":");
            try writeString(w, p);
            try w.writeByte('}');
        },
        .write => |x| {
            try w.writeAll("{\"Write\":{\"path\":");
            try writeString(w, x.path);
            try w.writeAll(",\"text\":");
            try writeString(w, x.text);
            try w.writeByte('}');
        },
        .browse => |u| {
            try w.writeAll("{\"Browse\":{\"url\":");
            try writeString(w, u);
            try w.writeByte('}');
        },
        .tool => |t| {
            try w.writeAll("{\"Tool\":{\"name\":");
            try writeString(w, t.name);
            try w.writeAll(",\"input\":");
            try w.writeAll(t.input); // byte for byte, as the model gave it
            try w.writeByte('}');
        },
    }
    try w.writeByte('}');
}

/// `{"id":N,"text":"...","failed":true}` (failed only when true).
pub fn writeOutput(w: *Writer, o: Output) Writer.Error!void {
    try w.writeAll("{\"id\":");
    try writeInt(w, o.id);
    try w.writeAll(",\"text\":");
    try writeString(w, o.text);
    if (o.failed) try w.writeAll(",\"failed\":true");
    try w.writeByte('}');
}

pub fn writeMessage(w: *Writer, m: Message) Writer.Error!void {
    switch (m) {
        .user => |s| {
            try w.writeAll("{\"User\":");
            try writeString(w, s);
        },
        .tool => |o| {
            try w.writeAll("{\"Tool\":");
            try writeOutput(w, o);
        },
        .summary => |sm| {
            try w.writeAll("{\"Summary\":{\"text\":");
            try writeString(w, sm.text);
            try w.writeAll(",\"replaced\":");
            try writeInt(w, sm.replaced);
            try w.writeByte('}');
        },
        .agent => |a| {
            try w.writeAll("{\"Agent\":{");
            var first = true;
            if (a.text) |t| {
                try w.writeAll("\"text\":");
                try writeString(w, t);
                first = false;
            }
            if (a.calls.len != 0) {
                if (!first) try w.writeByte(',');
                try w.writeAll("\"calls\":[");
                for (a.calls, 0..) |d, i| {
                    if (i != 0) try w.writeByte(',');
                    try w.writeAll("{\"id\":");
                    try writeInt(w, d.id);
                    try w.writeAll(",\"call\":");
                    try writeCall(w, d.call);
                    try w.writeByte('}');
                }
                try w.writeByte(']');
            }
            try w.writeByte('}');
        },
    }
    try w.writeByte('}');
}

/// A Message encoded into a fresh exact-size allocation from `gpa`. Room for
/// its text is taken at once: growing a large one step by step held the old
/// buffer and the new together, and linear memory keeps its high-water mark.
pub fn encodeMessage(gpa: Allocator, m: Message) []u8 {
    const text = switch (m) {
        .user => |u| u,
        .tool => |o| o.text,
        .agent => |a| a.text orelse "",
        .summary => |sm| sm.text,
    };
    var out = Writer.Allocating.initCapacity(gpa, 64 +| text.len) catch oom();
    writeMessage(&out.writer, m) catch oom();
    return out.toOwnedSlice() catch oom();
}

// ---------------------------------------------------------------- paths

/// Whether a file call's path stays inside the workspace: relative, no NUL,
/// and never climbing above the root once `.` and `..` are resolved
/// component by component.
pub fn insideWorkspace(path: []const u8) bool {
    if (path.len != 0 and path[0] == '/') return false;
    if (std.mem.indexOfScalar(u8, path, 0) != null) return false;
    var depth: usize = 0;
    var it = std.mem.splitScalar(u8, path, '/');
    while (it.next()) |part| {
        if (part.len == 0 or std.mem.eql(u8, part, ".")) continue;
        if (std.mem.eql(u8, part, "..")) {
            if (depth == 0) return false;
            depth -= 1;
        } else depth += 1;
    }
    return true;
}
