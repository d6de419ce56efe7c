#!/usr/bin/env bash
# Makes the example prompt voices in this folder with espeak-ng, so the project ships no third-party recordings.
# Each NAME.wav (16 kHz mono int16, the rate upstream loads prompts at) has its transcript in NAME.txt.
# Needs: espeak-ng, ffmpeg (apt-get install espeak-ng ffmpeg). Output is deterministic; rerun to regenerate.
set -euo pipefail
cd "$(dirname "$0")"

make_voice() {  # name espeak-voice words-per-minute pitch text
    local name=$1 voice=$2 wpm=$3 pitch=$4 text=$5 tmp
    tmp=$(mktemp --suffix=.wav)
    espeak-ng -v "$voice" -s "$wpm" -p "$pitch" -w "$tmp" "$text"
    ffmpeg -loglevel error -y -i "$tmp" -ar 16000 -ac 1 -sample_fmt s16 -bitexact -map_metadata -1 "$name.wav"
    rm -f "$tmp"
    printf '%s\n' "$text" > "$name.txt"
    echo "assets/$name.wav"
}

make_voice en_female "en-us+f3" 150 60 "Hello there. I am an example voice made by a speech synthesizer, for cloning tests."
make_voice en_male "en-gb+m3" 145 40 "Good morning. This short recording gives the model a voice to imitate."
make_voice zh_male "cmn" 140 50 "你好，这是一个用于语音克隆的示例声音。"
