//! Builds the devd reasoning core: `zig build --prefix <DIR>` writes
//! <DIR>/bin/devd_core.wasm (wasm32-freestanding, no imports, ABI 2).
const std = @import("std");

/// Every symbol the module exports besides `memory`, and nothing else.
const exports = [_][]const u8{
    "dev_abi",
    "dev_alloc",
    "dev_release",
    "dev_new",
    "dev_restore",
    "dev_step",
    "dev_snapshot",
    "dev_free",
    "dev_pending",
    "dev_apply",
    "dev_resume",
    "dev_ignored",
    "dev_out_of_memory",
    "dev_transcript",
};

pub fn build(b: *std.Build) void {
    // ReleaseSafe by default: a failed safety check traps (the host sees
    // PANIC) instead of corrupting the session silently.
    const optimize = b.option(std.builtin.Optimize, "optimize", "Optimization mode (default: safe)") orelse .safe;
    const target = b.resolveTargetQuery(.{ .cpu_arch = .wasm32, .os_tag = .freestanding });

    const mod = b.createModule(.{
        .root_source_file = b.path("src/exports.zig"),
        .target = target,
        .optimize = optimize,
        // Always stripped: an unstripped build embeds absolute paths, which
        // breaks byte-for-byte reproducibility across working copies.
        .strip = true,
        .single_threaded = true,
    });
    mod.export_symbol_names = &exports;

    const exe = b.addExecutable(.{ .name = "devd_core", .root_module = mod });
    exe.entry = .disabled;
    exe.rdynamic = false; // -rdynamic would also export __stack_pointer
    exe.export_memory = true;
    // The host's cap per session (devd serve --session-memory, 64 MiB by default) is what binds; the module's own
    // bound only keeps a host that sets none from growing it without end.
    exe.max_memory = 1024 * 1024 * 1024;
    // The stack sits first in linear memory, so an overflow faults (a trap)
    // instead of corrupting data. The core's deepest path needs a few KiB;
    // 256 KiB (instead of the default 1 MiB) keeps the initial memory small.
    exe.stack_size = 256 * 1024;
    b.installArtifact(exe);

    // `zig build test`: the pure-logic unit tests, run natively.
    const tests = b.addTest(.{ .root_module = b.createModule(.{
        .root_source_file = b.path("src/tests.zig"),
        .target = b.graph.host,
        .optimize = .Debug,
    }) });
    const run_tests = b.addRunArtifact(tests);
    b.step("test", "Run the core's unit tests natively").dependOn(&run_tests.step);
}
