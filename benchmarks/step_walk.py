"""Which of specdecode's files and functions one greedy speculative step passes through.

Profiles one `generate` call of the default pair (bfloat16, draft model only, γ = 4) and prints
(1) the call stack from `SpeculativeDecoder.generate` down to the acceptance rule
(verify.greedy_lenient_step), and (2) every distinct function entered during one steady-state
`Engine.step` (comprehensions left out), with and without the model kernels (models/, native/).
docs/ARCHITECTURE.md quotes its output.

    python benchmarks/step_walk.py
"""
import sys

from specdecode import SamplingParams, SpeculativeDecoder


def main() -> int:
    decoder = SpeculativeDecoder(dtype="bfloat16", num_speculative_tokens=4, free_drafts="off")
    steps, stack = [], []

    def where(frame):
        return frame.f_code.co_filename.split("/specdecode/", 1)[1], frame.f_code.co_qualname

    def profile(frame, event, _):
        if event != "call" or "/specdecode/" not in frame.f_code.co_filename:
            return
        key = where(frame)
        if key == ("engine/engine.py", "Engine.step"):
            steps.append([])
        if steps and key not in steps[-1] and "<" not in key[1]:
            steps[-1].append(key)
        if key[1] == "greedy_lenient_step" and not stack:
            while frame is not None:
                if "/specdecode/" in frame.f_code.co_filename:
                    stack.append(where(frame))
                frame = frame.f_back

    sys.setprofile(profile)
    decoder.generate("def add(a, b):\n    return", chat=False, max_new_tokens=12,
                     sampling=SamplingParams(temperature=0))
    sys.setprofile(None)
    print(f"generate → the acceptance rule: {len(stack)} functions in {len({f for f, _ in stack})} files")
    for file, function in reversed(stack):
        print(f"  {file}: {function}")
    step = steps[2]  # past the prompt read and the draft's first read
    own = [(f, n) for f, n in step if not f.startswith(("models/", "native/"))]
    print(f"one steady step: {len(step)} functions in {len({f for f, _ in step})} files; outside models/ and "
          f"native/: {len(own)} functions in {len({f for f, _ in own})} files")
    for file in sorted({f for f, _ in own}):
        print(f"  {file}: {', '.join(n for f, n in own if f == file)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
