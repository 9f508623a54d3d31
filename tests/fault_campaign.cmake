# The checkpoint fault campaign (tests/trainer/run_fault_campaign.sh): kill -9 of one of two ranks
# inside a checkpoint, a checkpoint overflowing a size-limited file (and a full tmpfs where mount
# is permitted), a flipped byte in a shard and a truncated manifest; after each, resume: auto
# takes the newest intact checkpoint and the losses equal an uninterrupted run's bit for bit.
foreach(trial kill9 disk_full flipped_byte truncated_manifest)
  add_test(NAME FaultCampaign.${trial}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/trainer/run_fault_campaign.sh ${PROJECT_BINARY_DIR}
                   ${PROJECT_SOURCE_DIR} ${trial})
  set_tests_properties(FaultCampaign.${trial} PROPERTIES LABELS "cpu;mpi" TIMEOUT 600)
endforeach()
