"""Checks for each lesson's exercises.

The same check runs on the engine's code in CI (tests/) and on the learner's code in the lesson
notebook. Each compares against an independent oracle (Hugging Face transformers or plain torch)
and raises AssertionError with a hint when the numbers differ.
"""
import inspect
import os
import re
import types

STUB_MESSAGE = re.compile(r"Exercise (\d+\.\d+\w*)")
# A stub as an error message quotes it: repr(error) (Triton's interpreter), or the stub's line of source
# (Triton's compiler, which rejects a `raise` in a kernel and quotes the kernel up to that line)
QUOTED_STUB = re.compile(r"""NotImplementedError\(\s*(["'])(Exercise \d+\.\d+\w*.*?)\1\s*\)""")
IPYTHON_HISTORY = re.compile(r"_+|_i+\d*|_\d+|_[oid]h")  # Jupyter's names for past inputs and outputs


def _stub_exercises(code) -> set[str]:
    """Exercise numbers in the stub messages a code object (or any function nested in it) raises."""
    found = set()
    for const in code.co_consts:
        if isinstance(const, str) and STUB_MESSAGE.match(const):
            found.add(STUB_MESSAGE.match(const).group(1))
        elif inspect.iscode(const):
            found |= _stub_exercises(const)
    return found


def unfinished_exercises(namespace: dict) -> dict[str, str]:
    """{exercise number: where} for every stub still in the functions and classes a notebook defined."""
    found = {}
    for name, value in namespace.items():
        if inspect.isfunction(getattr(value, "fn", None)):  # a Triton kernel or helper: its Python function
            value = value.fn
        if getattr(value, "__module__", None) != "__main__" or IPYTHON_HISTORY.fullmatch(name):
            continue
        members = vars(value).items() if inspect.isclass(value) else [(None, value)]
        for member, obj in members:
            obj = obj.fget if isinstance(obj, property) else getattr(obj, "__func__", obj)
            obj = inspect.unwrap(obj) if callable(obj) else obj  # under a decorator (@torch.inference_mode())
            code = getattr(obj, "__code__", None)
            for number in _stub_exercises(code) if code else ():
                found.setdefault(number, f"{name}.{member}" if member else name)
    def order(item):  # "3.1b" -> (3, 1, "b")
        lesson, number, part = re.fullmatch(r"(\d+)\.(\d+)(\w*)", item[0]).groups()
        return int(lesson), int(number), part

    return dict(sorted(found.items(), key=order))


def stub_error(error: BaseException) -> BaseException | None:
    """The error in `error`'s chain that an exercise stub raised, or None. Usually `error` itself, a
    NotImplementedError; but Triton wraps what a kernel raises. Its interpreter (a CPU) raises an
    InterpreterError from the stub's NotImplementedError, once per kernel it passes through (a `__cause__`
    chain); its compiler (a GPU) cannot compile a `raise` at all, and its CompilationError only quotes the
    stub's line. So: the first NotImplementedError among `error`, its causes and contexts, or else the first
    of Triton's errors whose message quotes a stub."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    found = [e for e in chain if isinstance(e, NotImplementedError)]
    found += [e for e in chain if type(e).__module__.startswith("triton") and QUOTED_STUB.search(str(e))]
    return found[0] if found else None


def report_unfinished_exercises(namespace: dict) -> None:
    """In Jupyter: when a cell stops at an exercise stub, list under the error every exercise of this notebook
    that is still a stub. The lesson's checks and payoffs run your code from this notebook, so each of them
    needs the exercises it goes through."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return

    def explain(shell, etype, value, tb, tb_offset=None):
        stub = stub_error(value)
        if stub is None or not type(value).__module__.startswith("triton"):
            shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        elif isinstance(stub, NotImplementedError):  # Triton's interpreter: the stub's own error, not its wrappers
            shell.showtraceback((type(stub), stub, stub.__traceback__), tb_offset=tb_offset)
        else:  # Triton's compiler: the error whose message quotes the stub's line
            shell.showtraceback((type(stub), stub, stub.__traceback__), exception_only=True)
        left = unfinished_exercises(namespace) if stub is not None else {}
        if left:
            print("This cell runs your code from this notebook. Exercises still to write: "
                  + ", ".join(f"{number} ({where})" for number, where in left.items())
                  + ". Write them, run their cells, then run this cell again.")

    shell.set_custom_exc((Exception,), explain)  # any error: a stub's may come wrapped (Triton's kernels)


def namespace_of(cls) -> dict:
    """The globals a class's methods run with: in a lesson the notebook's names (its own Sequence, say),
    in the package its module's. A check that builds objects for the class under test takes them from here."""
    for value in vars(cls).values():
        function = getattr(value, "__func__", value)
        if hasattr(function, "__globals__"):
            return function.__globals__
    raise TypeError(f"{cls.__name__} defines no method")


def with_reference(cls, reference, *names: str, own_globals: bool = True) -> type:
    """cls with the methods `names` taken from `reference` (the package's class): a check of one exercise
    then runs no other exercise's code, and a mistake fails only the exercise that made it. They run with
    cls's own globals (a notebook's Sequence, SequenceStatus, ...), as if written there, or with own_globals
    False with the reference's (so the reference's helpers too). (Not for a method that calls super() without
    arguments: its class is the reference's.)"""
    world = namespace_of(cls) if own_globals else None
    methods = {}
    for name in names:
        f = inspect.getattr_static(reference, name)
        methods[name] = types.FunctionType(f.__code__, world or f.__globals__, f.__name__, f.__defaults__,
                                           f.__closure__)
        methods[name].__kwdefaults__, methods[name].__qualname__ = f.__kwdefaults__, f"{cls.__qualname__}.{name}"
    return type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__, **methods})


def first_difference(got: list, want: list, what: str = "item", shown: int = 5) -> str:
    """Where two lists part, said first: 'token 3 on, got [..], want [..] (lengths 12 and 12)'."""
    got, want = list(got), list(want)
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    more = ", ..." if max(len(got), len(want)) > i + shown else ""
    return (f"{what} {i} on, got {str(got[i:i + shown])[:-1]}{more}], want {str(want[i:i + shown])[:-1]}{more}] "
            f"(lengths {len(got)} and {len(want)})").replace("[, ...]", "[...]")


LESSON_TIME_LIMIT = 300  # seconds: `make check`'s time limit for one lesson unless CHECK_TIMEOUT says otherwise
RAISE_LIMIT = "on a slow or busy machine, raise the time limits: make check CHECK_TIMEOUT=600"


def time_limit(seconds: float) -> float:
    """A check's own time limit: `seconds`, scaled up as much as CHECK_TIMEOUT (the environment variable that
    `make check CHECK_TIMEOUT=600` sets) raises the lesson's limit above its default; never scaled down."""
    try:
        scale = float(os.environ.get("CHECK_TIMEOUT", LESSON_TIME_LIMIT)) / LESSON_TIME_LIMIT
    except ValueError:
        scale = 1.0
    return seconds * max(1.0, scale)
