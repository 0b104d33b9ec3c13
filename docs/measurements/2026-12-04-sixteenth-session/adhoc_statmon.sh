#!/bin/bash
# print per-0.5s cpu busy fraction
prev=($(head -1 /proc/stat))
while true; do sleep 0.5; cur=($(head -1 /proc/stat));
 idle=$(( (${cur[4]}+${cur[5]}) - (${prev[4]}+${prev[5]}) ));
 tot=0; for i in 1 2 3 4 5 6 7 8; do tot=$((tot + ${cur[$i]} - ${prev[$i]})); done
 usr=$(( ${cur[1]}-${prev[1]} )); sys=$(( ${cur[3]}-${prev[3]} ))
 echo "$(date +%s.%N | cut -c1-14) busy=$(( 100*(tot-idle)/tot ))% usr=$usr sys=$sys idle=$idle"; prev=(${cur[@]}); done
