"""Emulated multi-host benchmark: tfdist bucketed and one-collective, Horovod's loop and MWMS, on shaped links.

    .venv/bin/python scripts/benchmarks/multihost_benchmark.py --rate_gbit 1 --model resnet50 --batch_size 8 \\
        --modes bucketed one-collective horovod mwms --bucket_mb 25 --repeats 2 --steps 5 \\
        --timeline bucketed --out docs/benchmarks/multihost-2026-11-23-resnet50-1gbit

Two (--hosts) network namespaces on a veth pair shaped with tc (tests/emulate_hosts.py), one
rank per host started with `ip netns exec` and an srun step's SLURM_* variables, so tfdist's
`launch.prepare()` runs the Gloo rendezvous over the namespace addresses (mwms gets TF_CONFIG with
the host names). Every mode, and the 1-rank baseline, runs each rank on one core of its own
(taskset: host i on cpu i) with 1 intra-op and 2 inter-op threads, oneDNN on. Modes run once per
repeat, in alternating order. Modes: ready (HorovodStrategy's default, bucket_mb=None: each
gradient as it exists), bucketed (HorovodStrategy(bucket_mb=--bucket_mb)), bucketed:<MB> (another
size), one-collective (bucket_mb=0), each optionally with ~<ms> (Horovod's cycle) and +<method>
(compression: +powersgd:4, +topk:0.001, +fp16, +bf16), e.g. ready~1+powersgd:4, and /sharded
(shard_optimizer_state=True, last: ready+fp16/sharded); horovod (its loop with
DistributedGradientTape), horovod_fit (its DistributedOptimizer with model.fit), mwms;
none@each runs the 1-rank baseline in every host at once, without any exchange: what the emulated
hosts' sharing of one machine (its memory bandwidth and caches) costs a step by itself (as
ranks_per_node.py's `apart`).
A mode may start with environment settings for its ranks ("HOROVOD_CYCLE_ON_ENQUEUE=0 ready").
--keras keras3 runs the Keras modes on Keras 3, --loss_scale wraps their optimizer in
LossScaleOptimizer. --delay_ms adds a one-way delay to the link (netem, or on kernels without it
tests/delay_line.py); the measured round trip is in the output.

Per mode: median step (warm-up excluded, every step of rank 0 of every run pooled), exposed
communication = step - step of the 1-rank baseline, efficiency = baseline / step, and
`tfdist-predict`'s step for the same inputs (baseline step, gradient bytes, link) with its error
(a sparse gradient counts as the rows it sends, gathered: `tfdist-predict --sparse_mb`);
with none@each, each mode's step beyond it (the exchange's own cost on hosts that share a machine).
Writes <out>.json (every step of every rank of every run, the link as measured, the command,
`lscpu`'s model) and <out>.md (the table); with --timeline, a Horovod timeline of one extra run of
that mode and its overlap evidence (scripts/benchmarks/multihost/timeline_overlap.py).
"""

import argparse
import gzip
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # emulate_hosts: one implementation, shared with the tests
sys.path.insert(0, os.path.join(ROOT, "scripts", "benchmarks", "multihost"))
import emulate_hosts  # noqa: E402
import timeline_overlap  # noqa: E402
import worker  # noqa: E402

WORKER = os.path.join(ROOT, "scripts", "benchmarks", "multihost", "worker.py")
THREADS = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2", "TF_ENABLE_ONEDNN_OPTS": "1"}


class RunFailed(RuntimeError):
    pass


def mode_env(name):
    """'A=1 B=2 ready' -> ({'A': '1', 'B': '2'}, 'ready'): a mode's own environment, and the mode."""
    *settings, bare = name.split(" ")
    if not all("=" in s for s in settings):
        raise SystemExit(f"--modes {name!r}: expected NAME=VALUE settings before one mode")
    return dict(s.split("=", 1) for s in settings), bare


def parse_mode(name, bucket_mb):
    """A mode name -> (kind, bucket, cycle_ms, compression).

    'bucketed' -> ('tfdist', bucket_mb, None, None); 'bucketed:4' -> 4 MB buckets; 'one-collective'
    -> bucket 0; 'ready' -> each gradient as it exists (bucket 'ready'); a suffix '~2' sets
    Horovod's cycle to 2 ms ('ready~2'), '+powersgd:4' / '+topk:0.01' / '+fp16' / '+bf16' a compression
    ('ready+powersgd:4'). A suffix '@1' ('horovod@1') runs that mode as a 1-rank job in host 0;
    'none@each' runs the 1-rank baseline in every host at once (see apart()).
    '/sharded' after a tfdist mode ('ready/sharded') adds shard_optimizer_state=True (see sharded()).
    """
    body, _, where = mode_env(name)[1].partition("@")
    if where not in ("", "1", "each") or (where == "each" and body != "none"):
        raise SystemExit(f"--modes {name!r}: '@1' runs a mode as one rank, 'none@each' the baseline in every host")
    body = body.removesuffix("/sharded")
    body, _, compression = body.partition("+")
    body, _, cycle = body.partition("~")
    base, _, size = body.partition(":")
    extras = (float(cycle) if cycle else None, compression or None)
    if base == "bucketed":
        return ("tfdist", float(size) if size else bucket_mb, *extras)
    if base == "one-collective" and not size:
        return ("tfdist", 0.0, *extras)
    if base == "ready" and not size:
        return ("tfdist", "ready", *extras)
    if base in ("horovod", "horovod_fit", "mwms", "none") and not size and extras == (None, None) and not sharded(name):
        return base, 0.0, None, None
    raise SystemExit(f"--modes {name!r}: expected bucketed[:MB], one-collective or ready (each with an "
                     "optional ~<cycle ms>, +<compression> and /sharded), horovod, horovod_fit or mwms")


def apart(name):
    """Whether mode `name` is 'none@each': every host's 1-rank baseline at once, no exchange."""
    return mode_env(name)[1] == "none@each"


def sharded(name):
    """Whether mode `name` shards the optimizer state ('ready/sharded', 'bucketed:4+fp16/sharded')."""
    return mode_env(name)[1].split("@")[0].endswith("/sharded")


def clean_env():
    drop = ("SLURM_", "HOROVOD_", "TF_CONFIG", "TFDIST_RENDEZVOUS", "OMPI_", "PMI_", "TFDIST_STARTUP")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", **THREADS}


def rank_env(hosts, mode, rank, job):
    """What the launcher would give rank `rank`: an srun step's variables, or TF_CONFIG for mwms."""
    n = len(hosts.names)
    if mode == "mwms":
        workers = [f"{h}:{23000 + 10 * (job % 500) + i}" for i, h in enumerate(hosts.hostnames)]
        return {"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})}
    return {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": str(n), "SLURM_NTASKS": str(n),
            "SLURM_LOCALID": "0", "SLURM_NODEID": str(rank), "SLURM_JOB_NODELIST": ",".join(hosts.hostnames),
            "SLURM_TASKS_PER_NODE": f"1(x{n})", "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0"}


def launch(hosts, name, args, out_dir, job, timeline=None, profile_dir=None):
    """Run mode `name` (one rank per host, or the 1-rank baseline in host 0); {rank: result}."""
    mode, bucket, cycle, compression = parse_mode(name, args.bucket_mb)
    single = (mode == "none" and not apart(name)) or name.endswith("@1")
    ranks = 1 if single else len(hosts.names)
    os.makedirs(out_dir, exist_ok=True)
    argv = [sys.executable, WORKER, "--mode", mode, "--bucket_mb", bucket, "--model", args.model,
            "--batch_size", args.batch_size, "--image_size", args.image_size,
            "--num_classes", args.num_classes, "--warmup", args.warmup,
            "--steps", args.steps, "--out", out_dir]
    argv += ["--cycle_ms", cycle] if cycle is not None else []
    argv += ["--compression", compression] if compression else []
    argv += ["--keras", args.keras] + (["--loss_scale"] if args.loss_scale else [])
    argv += ["--shard_optimizer_state"] if sharded(name) else []
    argv += ["--profile_dir", profile_dir] if profile_dir else []
    argv += ["--profile_steps", args.profile_steps] if profile_dir and args.profile_steps else []
    argv += ["--global_input"] if args.global_input else []
    procs = []
    try:
        for r in range(ranks):
            env = {**clean_env(), **({} if single else rank_env(hosts, mode, r, job)), **mode_env(name)[0]}
            env.update({worker.LINK_PID: str(hosts.delay_line_pid)} if hosts.delay_line_pid else {})
            if timeline:
                env["HOROVOD_TIMELINE"] = timeline
            log = open(os.path.join(out_dir, f"task{r}.log"), "w")
            procs.append((hosts.run(r, argv, core=r % os.cpu_count(), env=env, cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + args.run_timeout
        for proc, _ in procs:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RunFailed(f"{name}: timed out after {args.run_timeout}s\n{tails(out_dir)}") from None
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
    codes = [proc.returncode for proc, _ in procs]
    if any(codes):
        raise RunFailed(f"{name}: ranks exited with {codes}\n{tails(out_dir)}")
    return {r: json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(ranks)}


def tails(out_dir, lines=15):
    text = []
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("task"):
            kept = [l for l in open(os.path.join(out_dir, name)).read().splitlines() if " W0000 " not in l]
            text.append(f"--- {name}\n" + "\n".join(kept[-lines:]))
    return "\n".join(text)


def timed_ms(result):
    return [t * 1e3 for t in result["step_seconds"][result["warmup_steps_excluded"]:]]


def summarize(runs, args, link):
    """One row per mode: median step, exposed communication, efficiency, prediction and its error."""
    from tfdist.benchmark import step_model as predict

    ok = {name: [r for r in rs if "ranks" in r] for name, rs in runs.items()}
    steps = {name: [t for r in rs for t in timed_ms(r["ranks"]["0"])] for name, rs in ok.items() if rs}
    base = statistics.median(steps["none"]) if "none" in steps else None
    shared = next((statistics.median(steps[n]) for n in steps if apart(n)), None)
    alone = next((r["ranks"]["0"] for rs in ok.values() for r in rs if r["ranks"]["0"]["gradient_bytes"]), {})
    grad, sparse = alone.get("gradient_bytes"), alone.get("sparse_gradient_bytes") or 0
    rows = []
    for name in [m for m in runs if m in steps]:
        step = statistics.median(steps[name])
        row = {"mode": name, "runs": len(ok[name]), "failed": len(runs[name]) - len(ok[name]),
               "run_medians_ms": [round(statistics.median(timed_ms(r["ranks"]["0"])), 1) for r in ok[name]],
               "steps": len(steps[name]), "step_ms": step}
        cpus = [rank["thread_cpu_per_step"] for r in ok[name] for rank in r["ranks"].values()
                if rank.get("thread_cpu_per_step")]
        if cpus:  # medians over every rank and run
            row["thread_cpu_ms"] = {k: statistics.median(c[k] for c in cpus) for k in cpus[0]}
        names = [rank.get("thread_cpu_by_name") or {} for r in ok[name] for rank in r["ranks"].values()]
        if any(names):  # each thread name's median over every rank and run, 0 where a rank has none
            row["thread_cpu_by_name_ms"] = {n: statistics.median(c.get(n, 0.0) for c in names)
                                            for n in dict.fromkeys(n for c in names for n in c)}
        if shared and name != "none" and "@" not in name:
            row["beyond_apart_ms"] = step - shared
        if base and name != "none" and "@" not in name:
            mode, bucket, _, compression = parse_mode(name, args.bucket_mb)
            bucket = args.horovod_model_bucket_mb if bucket == "ready" else bucket
            row.update(exposed_ms=step - base, efficiency=base / step)
            modelled = {"tfdist": bucket, "mwms": 0.0, "horovod": args.horovod_model_bucket_mb,
                        "horovod_fit": args.horovod_model_bucket_mb}[mode]
            for label, gbit in (("nominal", args.rate_gbit), ("measured", link["goodput_gbit"])):
                if not gbit:
                    continue
                model = predict.sharded_step_time if sharded(name) else predict.step_time
                ranks = len(ok[name][0]["ranks"])  # compression: its wire bytes (one flat tensor) and flops
                rank = predict.compressed(predict.Rank(base / 1e3, grad - sparse), None, compression or "none",
                                          ranks, 20.0)[0]
                rank = predict.with_sparse(rank, sparse, ranks)
                p_step, _, p_comm = model(rank, predict.Link(gbit, link["rtt_ms"] / 2 * 1e3), ranks, 1,
                                          modelled * (1 << 20))
                row[f"predicted_ms_{label}_link"] = p_step * 1e3
                row[f"predicted_error_{label}_link"] = p_step * 1e3 / step - 1
                row[f"predicted_comm_ms_{label}_link"] = p_comm * 1e3
        rows.append(row)
    return {"baseline_ms": base, "apart_ms": shared, "gradient_bytes": grad, "rows": rows,
            "comparisons": comparisons(rows, args)}


def comparisons(rows, args):
    by = {r["mode"]: r for r in rows}
    out = {}
    one = by.get("one-collective")
    for name, row in by.items():
        bare = mode_env(name)[1]
        if bare.startswith("bucketed") and one and "exposed_ms" in row and one.get("exposed_ms", 0) > 0:
            out[f"{name}: hidden fraction of one-collective's exposed communication"] = 1 - row["exposed_ms"] / one["exposed_ms"]
            out[f"{name}: speed vs one-collective"] = one["step_ms"] / row["step_ms"]
        if bare.startswith(("bucketed", "ready", "one-collective")):
            for peer in ("horovod", "horovod_fit", "mwms"):
                if peer in by:
                    out[f"{name}: speed vs {peer}"] = by[peer]["step_ms"] / row["step_ms"]
    return out


def markdown(summary, meta):
    lines = [f"{meta['model']}, batch {meta['batch_size']}/rank, {meta['hosts']} hosts, link {meta['link']}; "
             f"baseline (1 rank, 1 core) {fmt(summary['baseline_ms'])} ms"
             + (f", every host's baseline at once (none@each) {fmt(summary['apart_ms'])} ms"
                if summary.get("apart_ms") else "")
             + f", gradients {(summary['gradient_bytes'] or 0) / 1e6:.1f} MB", "",
             "| mode | runs: median step ms | median step ms | exposed comm ms | efficiency | "
             "predicted ms (error), set rate | predicted ms (error), measured rate |",
             "|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        pred = [f"{fmt(r.get(f'predicted_ms_{k}_link'))} ({r.get(f'predicted_error_{k}_link', 0):+.1%})"
                if f"predicted_ms_{k}_link" in r else "-" for k in ("nominal", "measured")]
        eff = f"{r['efficiency']:.1%}" if "efficiency" in r else "-"
        runs = ", ".join(map(str, r["run_medians_ms"])) + (f" ({r['failed']} failed)" if r["failed"] else "")
        lines.append(f"| {r['mode']} | {runs} | {fmt(r['step_ms'])} | {fmt(r.get('exposed_ms'))} | {eff} | "
                     f"{pred[0]} | {pred[1]} |")
    lines += [""] + [f"- {k}: {v:.2f}" + ("x" if "speed" in k else "") for k, v in summary["comparisons"].items()]
    lines += [f"- {r['mode']}: {r['beyond_apart_ms']:.1f} ms a step beyond none@each (every host's baseline at "
              "once: the hosts' sharing of this machine without any exchange)" for r in summary["rows"]
              if "beyond_apart_ms" in r]
    from tfdist.benchmark import thread_cpu

    lines += [f"- {r['mode']}: {thread_cpu.describe(r['thread_cpu_ms'])} (medians of ranks and runs)"
              for r in summary["rows"] if "thread_cpu_ms" in r]
    for name, found in meta.get("timelines", {}).items():
        text = timeline_overlap.describe(found["overlap"]) if "overlap" in found else "FAILED: " + found["failed"][-300:]
        lines += ["", f"Horovod timeline of one extra {name} run: " + text.replace("\n", " ")]
    evidence = timeline_overlap.compare({k: v["overlap"] for k, v in meta.get("timelines", {}).items() if "overlap" in v})
    lines += [f"- {line}" for line in evidence]
    return "\n".join(lines) + "\n"


def fmt(x):
    return "-" if x is None else f"{x:.1f}"


def cpu_model():
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), "?")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate_gbit", type=float, default=1.0)
    parser.add_argument("--delay_ms", type=float, default=0.0, help="one-way: netem, else a delay line")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--num_classes", type=int, default=1000)
    parser.add_argument("--modes", nargs="+", default=["bucketed", "one-collective", "horovod", "mwms"])
    parser.add_argument("--bucket_mb", type=float, default=25)
    parser.add_argument("--no_baseline", action="store_true")
    parser.add_argument("--keras", choices=["tf_keras", "keras3"], default="tf_keras", help="every mode's Keras")
    parser.add_argument("--loss_scale", action="store_true",
                        help="every Keras mode wraps its optimizer in LossScaleOptimizer (float32 policy)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeline", nargs="+", default=[],
                        help="an extra run of each of these modes with HOROVOD_TIMELINE, analysed")
    parser.add_argument("--profile", nargs="+", default=[],
                        help="an extra run of each of these modes, 3 steps (or --profile_steps) TF-profiled on rank 0 "
                             "(<out>-profile-<mode>; read with tfdist-profile)")
    parser.add_argument("--profile_steps", type=int, help="steps in each --profile run (default 3, at most --steps)")
    parser.add_argument("--global_input", action="store_true",
                        help="tfdist and mwms fit a finite dataset batched by the global batch "
                             "(experimental_distribute_dataset) instead of per-replica batches")
    parser.add_argument("--horovod_model_bucket_mb", type=float, default=1.0,
                        help="how the predictor models Horovod's per-tensor allreduces (fine buckets)")
    parser.add_argument("--run_timeout", type=float, default=420)
    parser.add_argument("--work", default="/tmp/multihost-runs")
    parser.add_argument("--out", required=True, help="<out>.json and <out>.md")
    args = parser.parse_args(argv)
    names = (["none"] if not args.no_baseline else []) + args.modes
    for name in names:
        parse_mode(name, args.bucket_mb)
    link = emulate_hosts.Link(args.rate_gbit or None, args.delay_ms)
    meta = {"command": shlex.join([sys.executable, *sys.argv]), "cpu": cpu_model(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "model": args.model,
            "batch_size": args.batch_size, "hosts": args.hosts, "link": link.describe(), "threads": THREADS,
            "args": vars(args)}
    runs = {name: [] for name in names}
    job = int(time.time()) % 100000 * 10
    with emulate_hosts.NetworkNamespaces(args.hosts, link) as hosts:
        meta["measured_link"] = measured = {"goodput_gbit": hosts.measure_rate(0, 1, 32 << 20),
                                            "rtt_ms": hosts.measure_rtt(0, 1)}
        meta["delay_by"] = hosts.delay_by
        print(f"{meta['date']}: {args.hosts} hosts, link {link.describe()} (delay by {hosts.delay_by}): "
              f"measured {measured['goodput_gbit']:.3f} "
              f"Gbit/s TCP goodput, {measured['rtt_ms']:.3f} ms round trip", flush=True)
        for repeat in range(args.repeats):
            for name in (names if repeat % 2 == 0 else names[::-1]):
                job += 1
                out_dir = os.path.join(args.work, f"{job}-{re.sub(r'[^A-Za-z0-9_.~+-]', '_', name)}")
                try:
                    result = {"ranks": {str(k): v for k, v in launch(hosts, name, args, out_dir, job).items()}}
                    print(f"repeat {repeat + 1}: {name:36s} median step "
                          f"{statistics.median(timed_ms(result['ranks']['0'])):8.1f} ms", flush=True)
                except RunFailed as e:
                    result = {"failed": str(e)[-3000:]}
                    print(f"repeat {repeat + 1}: {name} FAILED\n{e}", flush=True)
                runs[name].append({**result, "repeat": repeat + 1, "job": job})
                save(args.out, meta, runs, summarize(runs, args, measured))
        meta["timelines"] = {}
        for name in args.timeline:
            job += 1
            path = os.path.abspath(f"{args.out}-timeline-{re.sub(r'[:/]', '_', name)}.json")  # ready/sharded
            try:
                result = launch(hosts, name, args, os.path.join(args.work, f"{job}-timeline"), job, timeline=path)
                found = timeline_overlap.analyse(path, summarize(runs, args, measured)["baseline_ms"])
                with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.remove(path)
                found["file"] = os.path.relpath(path + ".gz", ROOT)
                meta["timelines"][name] = {"file": found["file"], "step_ms": timed_ms(result[0]), "overlap": found}
                print(f"timeline of {name}: {timeline_overlap.describe(found)}", flush=True)
            except (RunFailed, ValueError, OSError) as e:
                meta["timelines"][name] = {"failed": str(e)[-3000:]}
                print(f"timeline run of {name} FAILED\n{e}", flush=True)
        meta["profiles"] = {}
        for name in args.profile:
            job += 1
            path = os.path.abspath(f"{args.out}-profile-{re.sub(r'[^A-Za-z0-9_.~+-]', '_', name)}")
            try:
                result = launch(hosts, name, args, os.path.join(args.work, f"{job}-profile"), job, profile_dir=path)
                meta["profiles"][name] = {"dir": os.path.relpath(path, ROOT), "step_ms": timed_ms(result[0])}
                print(f"TF profile of {name}: {path}", flush=True)
            except RunFailed as e:
                meta["profiles"][name] = {"failed": str(e)[-3000:]}
                print(f"profiled run of {name} FAILED\n{e}", flush=True)
    summary = summarize(runs, args, measured)
    save(args.out, meta, runs, summary)
    print("\n" + markdown(summary, meta))
    return 0


def save(out, meta, runs, summary):
    with open(f"{out}.json", "w") as f:
        json.dump({**meta, "summary": summary, "runs": runs}, f, indent=1)
    with open(f"{out}.md", "w") as f:
        f.write(f"Command ({meta['date']}, {meta['cpus']} vCPUs {meta['cpu']}):\n\n    {meta['command']}\n\n")
        f.write(markdown(summary, meta))


if __name__ == "__main__":
    sys.exit(main())
