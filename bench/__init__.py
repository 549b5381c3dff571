"""Measurements against Hugging Face transformers and CTranslate2, written as data.

    python -m bench regular      # T5-large-shaped random fp32 checkpoint, 100 tokens
    python -m bench families     # BART-large and NLLB-600M shapes, against the same references
    python -m bench speculative  # the benchmark pair, on held-out demo prompts
    python -m bench whisper      # real Whisper tiny.en and base transcribing espeak-ng's speech, 30 s and 5 minutes
    python -m bench whisper-profile  # where a 30 s window's time goes: ours, transformers', mlx-whisper's
    python -m bench rounding     # every family's logits: ours and transformers' float32 against float64
    python -m bench speech-demo  # the speech demo pair: held-out word error rate, drafts, speed, long-form
    python -m bench stages       # the benchmark pair's target over 1, 2 and 3 ranks (pipeline.py); T5-11B on paper
    python -m bench render       # docs/PERFORMANCE.md and the README's table, from bench/results/

Each command is a `run` that measures and returns plain data, and a `render`
that makes its table from that data (harness.py). Runs of ours and of the
references alternate, the references in processes of their own, and every
result names the machine it ran on. Modules by family of measurement:
decoding.py (regular, steps, speculative, families), batching.py (batch), serve.py (serve),
drafts.py (drafting, fresh, lookup), controls.py (processors, beams), memory.py (quantized, sizes),
long_inputs.py (encode, attention), blas.py, stages.py, speech.py (whisper), speech_profile.py (whisper-profile),
speech_demo.py, rounding.py; the checkpoints they run on are fixtures.py's, the references references.py's.
"""

from bench import (batching, blas, controls, decoding, drafts, long_inputs, memory, rounding, serve, speech, speech_demo,
                   speech_profile, stages)

# name -> (what it measures, run(args) -> data, render(data) -> Markdown), in the order docs/PERFORMANCE.md shows them
COMMANDS = {
    "regular": ("Regular decoding", decoding.run_regular, decoding.render_regular),
    "steps": ("Decode steps", decoding.run_steps, decoding.render_steps),
    "families": ("The BART family", decoding.run_families, decoding.render_families),
    "speculative": ("Speculative decoding", decoding.run_speculative, decoding.render_speculative),
    "drafting": ("num-draft auto", drafts.run_drafting, drafts.render_drafting),
    "fresh": ("In a fresh process", drafts.run_fresh, drafts.render_fresh),
    "lookup": ("Prompt lookup", drafts.run_lookup, drafts.render_lookup),
    "processors": ("Logits processors", controls.run_processors, controls.render_processors),
    "beams": ("Beam search", controls.run_beams, controls.render_beams),
    "batch": ("Batches", batching.run_batch, batching.render_batch),
    "serve": ("The server under load", serve.run_serve, serve.render_serve),
    "encode": ("Long prompts", long_inputs.run_encode, long_inputs.render_encode),
    "attention": ("A block of a long prompt's attention", long_inputs.run_attention, long_inputs.render_attention),
    "quantized": ("Quantized models", memory.run_quantized, memory.render_quantized),
    "sizes": ("Model sizes", memory.run_sizes, memory.render_sizes),
    "blas": ("The BLAS", blas.run_blas, blas.render_blas),
    "stages": ("Across machines: pipeline stages", stages.run_stages, stages.render_stages),
    "whisper": ("Whisper", speech.run_whisper, speech.render_whisper),
    "whisper-profile": ("Where a Whisper window's time goes", speech_profile.run_whisper_profile,
                        speech_profile.render_whisper_profile),
    "speech-demo": ("The speech demo pair", speech_demo.run_speech_demo, speech_demo.render_speech_demo),
    "rounding": ("Rounding against transformers", rounding.run_rounding, rounding.render_rounding),
}
