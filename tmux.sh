#!/usr/bin/env bash
# Follow a run's logs in one tmux session: trainer, orchestrator, inference and environment logs.
#
#   bash tmux.sh JOB OUTPUT_DIR
#   bash tmux.sh -s SESSION -o OUTPUT_DIR
#
# Creates a tmux session named JOB (or SESSION) with one window of four panes, each following
# OUTPUT_DIR/logs/... with `tail -F` (so files that do not exist yet are picked up when they
# appear): trainer.log, orchestrator.log, inference.log, and envs/**/*.log (re-globbed every few
# seconds, so environments that start logging later show up too).
# Attaches to it, unless already inside tmux ($TMUX) or TMUX_NO_ATTACH=1 (scripts, tests).
# An existing session of that name is reused, not duplicated. HPCRL_TMUX_SOCKET=name runs it on a
# separate tmux server (`tmux -L name`).
set -euo pipefail

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }

# Internal mode used by the env-logs pane: follow every logs/envs/**/*.log, restarting `tail` when
# the set of files changes.
if [[ ${1:-} == --follow-env-logs ]]; then
  dir=$2
  shopt -s globstar nullglob
  echo "following $dir/**/*.log (new files appear within 3 s)"
  tail_pid=""
  current=""
  trap 'if [[ -n $tail_pid ]]; then kill "$tail_pid" 2>/dev/null || true; fi; exit 0' TERM INT HUP
  while true; do
    files=("$dir"/**/*.log)
    listing="${files[*]:-}"
    if [[ $listing != "$current" ]]; then
      if [[ -n $tail_pid ]]; then
        kill "$tail_pid" 2>/dev/null || true
        wait "$tail_pid" 2>/dev/null || true  # 143: it was killed, as intended
      fi
      tail_pid=""
      current=$listing
      if [[ ${#files[@]} -gt 0 ]]; then
        tail -n 50 -F "${files[@]}" &
        tail_pid=$!
      fi
    fi
    sleep 3
  done
fi

session=""
out=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -s|--session) session=$2; shift 2 ;;
    -o|--output-dir) out=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "tmux.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    *)
      if [[ -z $session ]]; then session=$1
      elif [[ -z $out ]]; then out=$1
      else echo "tmux.sh: too many arguments" >&2; usage >&2; exit 2
      fi
      shift ;;
  esac
done
if [[ -z $session || -z $out ]]; then usage >&2; exit 2; fi
# tmux reads '.' and ':' in a session name as window/pane separators
if [[ $session == *[.:]* ]]; then echo "tmux.sh: session name may not contain '.' or ':'" >&2; exit 2; fi
command -v tmux >/dev/null || { echo "tmux.sh: tmux is not installed (apt-get install tmux)" >&2; exit 1; }

out=$(realpath -m "$out")  # absolute: the panes' shells start in tmux's cwd, not ours
logs=$out/logs
tm=(tmux)
[[ -n ${HPCRL_TMUX_SOCKET:-} ]] && tm+=(-L "$HPCRL_TMUX_SOCKET")
self=$(realpath "$0")

follow() {  # the shell command one pane runs: a title line, then tail -F of the file
  printf 'echo "== %s"; exec tail -n 200 -F %q' "$1" "$1"
}

if ! "${tm[@]}" has-session -t "=$session" 2>/dev/null; then
  # a fixed size: a detached session (no client yet) otherwise gets tmux's 80x24 default
  "${tm[@]}" new-session -d -s "$session" -n logs -x 220 -y 60 "$(follow "$logs/trainer.log")"
  "${tm[@]}" split-window -t "=$session:logs" -h "$(follow "$logs/orchestrator.log")"
  "${tm[@]}" split-window -t "=$session:logs" -v "$(follow "$logs/inference.log")"
  "${tm[@]}" split-window -t "=$session:logs.0" -v "$(printf 'exec bash %q --follow-env-logs %q' "$self" "$logs/envs")"
  "${tm[@]}" select-layout -t "=$session:logs" tiled >/dev/null
  "${tm[@]}" set-option -t "=$session" pane-border-status top >/dev/null 2>&1 || true
  # pane indices move with the splits and `tiled`: title each pane by the file it follows
  for p in $("${tm[@]}" list-panes -t "=$session:logs" -F '#{pane_index}'); do
    cmd=$("${tm[@]}" display-message -p -t "=$session:logs.$p" '#{pane_start_command}')
    case "$cmd" in
      *trainer.log*) title=trainer ;;
      *orchestrator.log*) title=orchestrator ;;
      *inference.log*) title=inference ;;
      *) title=envs ;;
    esac
    "${tm[@]}" select-pane -t "=$session:logs.$p" -T "$title"
  done
  echo "tmux session '$session' follows $logs"
else
  echo "tmux session '$session' exists: reusing it"
fi

# the run's web page (`hpcrl dashboard`, issue 51); from a laptop through an ssh tunnel to this host
port=${HPCRL_DASHBOARD_PORT:-8765}
echo "dashboard: hpcrl dashboard $out  ->  http://127.0.0.1:$port/"
echo "  (from your laptop: ssh -N -L $port:127.0.0.1:$port $(hostname -f 2>/dev/null || hostname)  then http://127.0.0.1:$port/)"

if [[ -n ${TMUX:-} || ${TMUX_NO_ATTACH:-0} == 1 ]]; then
  echo "attach with: ${tm[*]} attach -t $session"
else
  exec "${tm[@]}" attach -t "=$session"
fi
