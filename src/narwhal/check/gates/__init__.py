"""The gates, one module per gate: collected evidence in, a verdict with its evidence out.

Pure: no sockets, no files, no clock. Each gate function states what it proves in its
docstring; ``docs/preflight.md`` says the same for operators, with what each gate does not
prove. ``common`` holds what several gates share; ``slo_prediction`` the slo gate's load
predictions (the virtual-time simulator's replay and the analytic cross-check).
"""
