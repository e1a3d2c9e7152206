"""Hand-written stand-ins for a core, in WAT, for the host's failure paths."""

from __future__ import annotations

import wasmtime

# A module whose dev_abi never returns.
SPIN_ABI = wasmtime.wat2wasm('(module (func (export "dev_abi") (result i32) (loop (br 0)) (i32.const 1)))')

# A core built from types devd does not have: every step answers an action with a member Action lacks.
AHEAD = wasmtime.wat2wasm(
    r"""(module
  (memory (export "memory") 1)
  (data (i32.const 1024) "[{\"id\":1,\"op\":\"Save\",\"note\":null}]")
  (func (export "dev_abi") (result i32) i32.const 1)
  (func (export "dev_alloc") (param i32) (result i32) i32.const 2048)
  (func (export "dev_release") (param i32 i32))
  (func (export "dev_new") (param i32 i32 i32) (result i32) i32.const 0)
  (func (export "dev_step") (param i64 i32 i32 i32) (result i32)
    (i32.store (local.get 3) (i32.const 1024))
    (i32.store offset=4 (local.get 3) (i32.const 34))
    i32.const 0)
  (func (export "dev_free") (param i32)))"""
)


def core_with(step_body: str, abi: int = 2, extra: str = "", new_body: str = "i32.const 0") -> bytes:
    """A minimal ABI-2 core whose dev_step runs `step_body` (which must leave an i32 status)."""
    return wasmtime.wat2wasm(
        f"""(module
  {extra}
  (memory (export "memory") 1)
  (data (i32.const 1024) "[]")
  (func (export "dev_abi") (result i32) i32.const {abi})
  (func (export "dev_alloc") (param i32) (result i32) i32.const 2048)
  (func (export "dev_release") (param i32 i32))
  (func (export "dev_new") (param i32 i32 i32) (result i32) {new_body})
  (func (export "dev_step") (param i64 i32 i32 i32) (result i32)
    (i32.store (local.get 3) (i32.const 1024))
    (i32.store offset=4 (local.get 3) (i32.const 2))
    (i32.store offset=8 (local.get 3) (i32.const 2))
    {step_body})
  (func (export "dev_free") (param i32)))"""
    )


# dev_step spins until its deadline on a 14-byte event ({"Timer":true}) and answers [] to anything else.
SPIN_ON_TIMER = core_with("(if (i32.eq (local.get 2) (i32.const 14)) (then (loop (br 0)))) i32.const 0")
# dev_step spins for ever: only a deadline stops it.
SPIN_STEP = core_with("(loop (br 0)) i32.const 0")
# dev_step executes `unreachable`, as a Zig panic does.
PANIC_STEP = core_with("unreachable")
# A module that speaks an ABI devd does not: one past its own.
ABI_3 = core_with("i32.const 0", abi=3)
# A module that speaks ABI 1, which ABI 2 extends.
ABI_1 = core_with("i32.const 0", abi=1)
# A module that imports something.
IMPORTS = wasmtime.wat2wasm(
    '(module (import "env" "clock" (func (result i64))) (func (export "dev_abi") (result i32) i32.const 1))'
)
# A module whose dev_step has the wrong type.
WRONG_TYPE = wasmtime.wat2wasm(
    '(module (func (export "dev_abi") (result i32) i32.const 1) (func (export "dev_step") (param i32)))'
)
# dev_new spins for ever: starting a session only ends at its deadline.
SPIN_NEW = core_with("i32.const 0", new_body="(loop (br 0)) i32.const 0")
# A module whose "memory" export is a function.
MEMORY_NOT_MEMORY = wasmtime.wat2wasm(
    '(module (func (export "dev_abi") (result i32) i32.const 1) (func (export "memory") (result i32) i32.const 0))'
)


def slow_to_compile(functions: int = 400) -> bytes:
    """A working ABI-1 core carrying `functions` long unused functions: compiling it takes about a second here, and
    its dev_abi answers at once."""
    body = " ".join(["(local.get 0) (i32.const 7) (i32.mul) (local.set 0)"] * 200)
    extra = " ".join(f"(func $f{i} (param i32) (result i32) {body} (local.get 0))" for i in range(functions))
    return core_with("i32.const 0", extra=extra)


def _turn_then_spin(action: bytes, *, pending_traps: bool = False) -> bytes:
    """A core for an agent session whose turn ends its session: a Turn event (`{"Turn"...`: its third byte is T) is
    answered `action`, which `dev_pending` then reports; any other event (that action's result) spins until its
    deadline, as a core that loops for ever does. With `pending_traps`, `dev_pending` traps instead (the session is
    poisoned as its driver first asks what is pending)."""
    escaped = action.decode().replace('"', r"\"")
    pending = "unreachable" if pending_traps else ""
    return wasmtime.wat2wasm(
        f"""(module
  (memory (export "memory") 1)
  (data (i32.const 1024) "[]")
  (data (i32.const 1100) "{escaped}")
  (global $asked (mut i32) (i32.const 0))
  (func $answer (param $out i32) (param $at i32) (param $len i32)
    (i32.store (local.get $out) (local.get $at))
    (i32.store offset=4 (local.get $out) (local.get $len))
    (i32.store offset=8 (local.get $out) (local.get $len)))
  (func (export "dev_abi") (result i32) i32.const 2)
  (func (export "dev_alloc") (param i32) (result i32) i32.const 2048)
  (func (export "dev_release") (param i32 i32))
  (func (export "dev_new") (param i32 i32 i32) (result i32) i32.const 0)
  (func (export "dev_step") (param i64 i32 i32 i32) (result i32)
    (if (i32.ne (i32.load8_u offset=2 (local.get 1)) (i32.const 84)) (then (loop (br 0))))
    (global.set $asked (i32.const 1))
    (call $answer (local.get 3) (i32.const 1100) (i32.const {len(action)}))
    i32.const 0)
  (func (export "dev_pending") (param i64 i32) (result i32)
    {pending}
    (if (global.get $asked)
      (then (call $answer (local.get 1) (i32.const 1100) (i32.const {len(action)})))
      (else (call $answer (local.get 1) (i32.const 1024) (i32.const 2))))
    i32.const 0)
  (func (export "dev_free") (param i32)))"""
    )


# An agent session's core whose turn runs one command (`sleep 1`), and which spins on its result: the session ends
# (DEADLINE) under its driver, mid-turn.
ENDS_MID_TURN = _turn_then_spin(b'[{"id":1,"op":{"Exec":{"argv":["sleep","1"]}}}]')
# One whose session is poisoned mid-turn: its `dev_pending` traps (the driver asks it as it starts the turn).
POISONED_MID_TURN = _turn_then_spin(b'[{"id":1,"op":{"Exec":{"argv":["sleep","1"]}}}]', pending_traps=True)
