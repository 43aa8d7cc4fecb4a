"""CPU CI for the backward walks' barrier protocol (``hopper/bwd_walk.py``): the mbarrier waits and arrivals of each
role, read from the kernel builder's own source, replayed over several chunks under many interleavings.

A warp-specialised kernel whose roles hand tiles to one another hangs on the GPU if one wait can never be met (a
count that no role completes, a cycle of waits) or if a role falls two phases behind a barrier it polls by parity
(the wait then blocks on a phase that has already passed). Both show here as a replay that cannot finish, or as a
wait that observes a phase other than the one after the phase it observed before. The model: each role (a
warpgroup, or a producer warp) runs its loop over the chunks in program order as one unit whose arrivals count its
threads; a TMA's completion is its warp's arrival (the bytes are not modelled). Data races on tiles are not in it.
"""
from __future__ import annotations

import ast
import inspect
import random
import textwrap

import pytest

# the builders import tilelang at module import: the module is resolved per test
NCHUNKS = (1, 2, 3, 4, 7)
SEEDS = range(60)


def _const(node, env=None):
    return eval(compile(ast.Expression(node), "<protocol>", "eval"), {}, dict(env or {}))


def _names(node):
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _call(stmt, name):
    """``stmt`` as a call of ``T.<name>`` or of the bare macro ``name``, or None."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return None
    f = stmt.value.func
    hit = (isinstance(f, ast.Attribute) and f.attr == name) or (isinstance(f, ast.Name) and f.id == name)
    return stmt.value if hit else None


def _has_barrier(items):
    return any(o[0] in ("wait", "arrive") or (o[0] == "if" and _has_barrier(o[2] + o[3])) for o in items)


def _ops(stmts):
    """The barrier operations of a loop body, as templates over the chunk index ``it``."""
    out = []
    for s in stmts:
        if (c := _call(s, "barrier_wait")) is not None:
            out.append(("wait", c.args[0], c.args[1]))
        elif (c := _call(s, "barrier_arrive")) is not None:
            out.append(("arrive", c.args[0]))
        elif (c := _call(s, "refill")) is not None:
            # the shared macro: wait for the tile's release by the chunk before, then load it
            free, it = c.args[0], c.args[1]
            out.append(("if", ast.parse("it > 0", mode="eval").body,
                        [("wait", free, ast.parse("(it - 1) % 2", mode="eval").body)], []))
        elif isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
            out.append(("let", s.targets[0].id, s.value))
        elif isinstance(s, ast.If):
            body, orelse = _ops(s.body), _ops(s.orelse)
            if "tx" in _names(s.test):
                # a branch on the thread: every barrier op must be outside it, or the arrivals would not count
                assert not _has_barrier(body + orelse), ast.unparse(s)
                continue
            out.append(("if", s.test, body, orelse))
        elif isinstance(s, (ast.For, ast.With)):
            assert not _has_barrier(_ops(s.body)), f"a barrier op inside a nested loop: {ast.unparse(s)[:80]}"
    return out


def _unroll(templates, n_it):
    ops = []

    def run(items, env):
        for item in items:
            if item[0] == "let":
                try:
                    env[item[1]] = _const(item[2], env)
                except (NameError, TypeError, AttributeError):
                    env.pop(item[1], None)
            elif item[0] == "if":
                run(item[2] if _const(item[1], env) else item[3], env)
            elif item[0] == "wait":
                bar, idx = _barrier(item[1], env)
                ops.append(("wait", bar, idx, _const(item[2], env) % 2))
            else:
                ops.append(("arrive",) + _barrier(item[1], env))

    for it in range(n_it):
        run(templates, {"it": it})
    return ops


def _barrier(node, env):
    if isinstance(node, ast.Subscript):
        return node.value.id, _const(node.slice, env)
    return node.id, 0


def _branches(node, lo, hi):
    """The role chain ``if tx < a: ... elif tx < b: ... else: ...`` as (lo, hi, body) thread ranges."""
    out = []
    while True:
        cut = _const(node.test.comparators[0])
        out.append((lo, cut, node.body))
        lo = cut
        if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If) and "tx" in _names(node.orelse[0].test):
            node = node.orelse[0]
            continue
        out.append((lo, hi, node.orelse))
        return out


def _is_role_split(stmt):
    return (isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Compare) and isinstance(stmt.test.left, ast.Name)
            and stmt.test.left.id == "tx")


def _roles(body, lo, hi):
    """(threads, loop templates) of every role: a branch's own loop over the chunks, or its nested role split."""
    roles = []
    for a, b, stmts in _branches(next(s for s in body if _is_role_split(s)), lo, hi):
        if any(_is_role_split(s) for s in stmts):
            roles += _roles(stmts, a, b)
            continue
        loops = [s for s in stmts if isinstance(s, ast.For) and ast.unparse(s.iter) == "T.serial(n_it)"]
        assert len(loops) == 1, f"threads {a}-{b}: one loop over the chunks expected"
        roles.append((b - a, _ops(loops[0].body)))
    return roles


def protocol(builder):
    """(barrier arrive counts by name, roles as (threads, templates), threads) of a walk builder's kernel."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(builder)))
    counts = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "attr", None) == "alloc_barrier"):
            value = _const({k.arg: k.value for k in node.value.keywords}["arrive_count"])
            counts[node.targets[0].id] = value if isinstance(value, list) else [value]
    kernel = next(n for n in ast.walk(tree) if isinstance(n, ast.With)
                  and ast.unparse(n.items[0].context_expr).startswith("T.Kernel("))
    threads_node = next(k.value for k in kernel.items[0].context_expr.keywords if k.arg == "threads")
    threads = _const(threads_node, vars(inspect.getmodule(builder)))
    return counts, _roles(kernel.body, 0, threads), threads


def replay(counts, roles, n_it, seed):
    """Runs every role's unrolled ops under one interleaving (random, or each seed's fixed role priority). Returns
    the ops each role could not get past (empty: the walk finished)."""
    rng = random.Random(seed)
    flat = [(w, _unroll(t, n_it)) for w, t in roles]
    priority = list(range(len(flat)))
    rng.shuffle(priority)
    greedy = seed % 2 == 1  # odd seeds run one role as far ahead as it can go, the next, and so on
    phase = {(b, i): 0 for b, cs in counts.items() for i in range(len(cs))}
    pending = dict.fromkeys(phase, 0)
    seen = {}
    pc = [0] * len(flat)

    def ready(r):
        if pc[r] == len(flat[r][1]):
            return False
        op = flat[r][1][pc[r]]
        return op[0] == "arrive" or phase[op[1:3]] % 2 != op[3]

    while True:
        runnable = [r for r in range(len(flat)) if ready(r)]
        if not runnable:
            break
        r = min(runnable, key=priority.index) if greedy else rng.choice(runnable)
        op = flat[r][1][pc[r]]
        key = op[1:3]
        if op[0] == "arrive":
            pending[key] += flat[r][0]
            assert pending[key] <= counts[key[0]][key[1]], f"{key}: more arrivals than its count"
            if pending[key] == counts[key[0]][key[1]]:
                phase[key] += 1
                pending[key] = 0
        else:
            # the phase this wait observed: the latest completed one of its parity
            got = phase[key] - 1
            last = seen.get((r, key))
            assert got == (last + 1 if last is not None else got) and (last is not None or got in (-1, 0)), (
                f"role {r} waited on {key} and observed phase {got} after {last}: it fell a phase behind")
            seen[(r, key)] = got
        pc[r] += 1
    left = [flat[r][1][pc[r]] for r in range(len(flat)) if pc[r] < len(flat[r][1])]
    partial = {k: v for k, v in pending.items() if v}
    return left, partial


def _builders():
    from flashqla_kernels.gated_delta_rule.hopper import bwd_walk

    return {"plain": bwd_walk.build_bwd_walk, "ws": bwd_walk.build_bwd_walk_ws}


@pytest.mark.parametrize("kernel", ["plain", "ws"])
def test_walk_protocol_finishes_under_every_interleaving_tried(kernel):
    """Every role of the walk gets through n chunks (1 to 7) under 60 interleavings each, with no barrier left
    half-arrived and no wait observing a phase out of turn; the roles' threads cover the CTA."""
    counts, roles, threads = protocol(_builders()[kernel])
    assert sum(w for w, _ in roles) == threads
    assert len(roles) == {"plain": 5, "ws": 7}[kernel]  # the consumers (one or three warpgroups), four producer warps
    for n_it in NCHUNKS:
        for seed in SEEDS:
            left, partial = replay(counts, roles, n_it, seed)
            assert not left and not partial, f"{kernel}, {n_it} chunks, seed {seed}: stuck at {left}, {partial}"


def test_replay_catches_a_wait_no_role_meets_and_a_role_two_phases_behind():
    """The replay itself: a count one arrival short hangs; a consumer polling a per-chunk barrier only every other
    chunk (two phases behind after a lap) is caught."""
    counts, roles, _ = protocol(_builders()["ws"])
    short = dict(counts, ds_free=[384])  # A and B arrive 256 a chunk
    left, _ = replay(short, roles, 2, 0)
    assert left, "a barrier nobody completes must leave its waiter stuck"
    tmpl = ast.parse("T.barrier_wait(tr_rdy[0], 0)").body[0].value
    skip = [(w, [("if", ast.parse("it % 2 == 0", mode="eval").body, [("wait", tmpl.args[0], tmpl.args[1])], [])]
             + t) for w, t in roles[:1]] + roles[1:]
    failures = 0
    for seed in SEEDS:
        try:
            left, partial = replay(counts, skip, 4, seed)
            failures += bool(left or partial)
        except AssertionError:
            failures += 1
    assert failures, "a role that stops polling a barrier it waits on must be caught"
